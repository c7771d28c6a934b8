"""Integrations with the trainers people already use, each an optional extra; ``import koila_retry`` imports none.

* :mod:`koila_retry.integrations.transformers`: :func:`~koila_retry.integrations.transformers.adapt`
  a Hugging Face ``transformers.Trainer`` (the ``transformers`` extra).
* :mod:`koila_retry.integrations.lightning`: :class:`~koila_retry.integrations.lightning.OOMRecovery`,
  a Lightning ``Callback`` (the ``lightning`` extra).

See :doc:`/trainers`.
"""
