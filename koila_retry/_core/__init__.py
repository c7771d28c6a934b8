"""The retry core.

The engine and its policy, the caches, out-of-memory detection, device memory, and
agreement across ranks. It imports only from :mod:`koila_retry._common` and
:mod:`koila_retry.exceptions`.
"""
