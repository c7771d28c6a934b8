"""Pieces every layer shares; nothing here imports from the rest of the package."""
