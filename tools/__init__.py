"""Tools beside the library: benchmarks (``bench``, ``bench_systems``, ``bench_report``,
``bound_check``, ``loader_floor``), the demo, the cache stress tool, and two supported modules that
the test suite, the benchmarks and the demo all build on:

- ``tools.s3server``: ``SeaweedServer``, an embedded S3 server (SeaweedFS ``weed mini``) on free
  loopback ports (``python -m tools.s3server`` runs one);
- ``tools.slowlink``: ``SlowLink``, the loopback WAN emulator (bandwidth shared by all
  connections, per-request latency, injected faults, bytes metered at the proxy).

Their public classes are kept stable and tested (``tests/test_slowlink.py``). Import them from
the repository root (``tools`` is a package there, not part of the installed distribution).
"""
