"""Test infrastructure: the real processes the test suite (and benchmarks/) start.

* :mod:`tabloop.testing.procs`: free ports, the process handling every service shares (own
  session, parent-death signal, cleanup at interpreter exit and on SIGTERM), and helpers for
  HTTP processes (``wait_http_ready``, ``stop_process``);
* :mod:`tabloop.testing.postgres`: ``PostgresServer``, a throwaway PostgreSQL cluster;
* :mod:`tabloop.testing.kafka`: ``KafkaBroker`` (Tansu, optionally on SeaweedFS S3) and the
  kafka-python helpers (``create_topics``, ``consume_all``, ``committed_offsets``, ...).

``tests/conftest.py`` builds the pytest fixtures on them. Import from the modules themselves
(pyproject: pythonpath = ["."], --import-mode=importlib); this package re-exports nothing.
"""
