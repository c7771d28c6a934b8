"""The front ends, each an adapter of the engine.

Each describes its work (what one attempt runs, how rows are covered, what is kept)
and hands it to the engine.
"""
