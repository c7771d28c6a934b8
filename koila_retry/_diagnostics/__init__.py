"""What holds the memory and what to do about it.

Reports, profiles, offloading, and the message of a call that gives up.
"""
