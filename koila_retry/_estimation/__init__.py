"""Estimating peak memory on meta tensors, without running the call on real data."""
