"""Drop-in stand-ins for other libraries' out-of-memory helpers, on koila-retry's engine.

* :mod:`koila_retry.compat.accelerate`: ``find_executable_batch_size`` and
  ``release_memory`` from ``accelerate.utils``.
* :mod:`koila_retry.compat.toma`: the ``toma`` decorators, ``explicit`` and
  ``execute`` forms and cache types.

Each keeps the original's signatures, schedule of sizes and caching, and
neither needs the original installed. Underneath, the engine releases a failed
attempt's memory after leaving the ``except`` block, costs nothing when nothing
fails, logs, calls ``on_oom`` hooks and makes ranks agree. Where behaviour
differs on purpose, :doc:`/migrating` says how and why.
"""
