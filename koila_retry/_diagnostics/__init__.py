"""What holds the memory and what to do about it: reports, profiles, offloading, the message of giving up."""
