"""Integrations of koila-retry with the trainers people already use; each an optional extra."""
