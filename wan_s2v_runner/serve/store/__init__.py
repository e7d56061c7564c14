"""The job stores of ``wan-s2v serve``: the one interface (:mod:`.protocol`), the rules both
drivers share (:mod:`.rules`), and the drivers: one server's SQLite file (:mod:`.sqlite`) and the
PostgreSQL queue servers share (:mod:`.postgres`). ``tests/test_store_contract.py`` runs one
contract suite against both.
"""
