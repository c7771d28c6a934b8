"""Pieces every layer shares.

Units, counters, live-storage tracking, and walking objects and frames. Nothing here
imports from the rest of the package.
"""
