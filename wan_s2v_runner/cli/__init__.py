"""The command line, ``wan-s2v`` and ``python -m wan_s2v_runner`` (:mod:`.main`): reads the flags,
the TOML run file and the environment into a spec and hands it to the room that does the work:
the launcher (``run``, ``resume``, ``batch``, ``demo``, ``doctor``, ``warm``; ``cache`` lists and clears
the caches: :mod:`.cache`) or the server
(``serve``, ``submit``, ``jobs``). The only room that imports both.

May import: shared, launcher, serve, preflight, demo.
"""
