"""The job stores of ``wan-s2v serve``, a driver package after River's: the one driver interface
(:mod:`.protocol`: :class:`~.protocol.JobStore`), the rules every driver shares (:mod:`.rules`),
the drivers (one server's SQLite file: :mod:`.sqlite`; the PostgreSQL queue servers share:
:mod:`.postgres`), and the contract every driver must pass (:mod:`.contract`: its checks, run with
a harness of the driver's own; ``tests/test_store_contract.py`` runs them for both).
"""
