"""The command line: ``python -m koila_retry demo`` and ``estimate``."""
