"""Launcher side: the user's process. Given a group spec (the command line's flags, generated from
the spec by :mod:`.flags`, are parsed by ``wan_s2v_runner.cli``), it runs preflight, writes the
run directory, spawns each node's agent (``wan_s2v_runner.rank.agent``, torch elastic's; its
command: :mod:`.spawn`; or forks it from the node's warm agent: :mod:`.warm`) and supervises it
(:mod:`.processes` tracks the process tree, :mod:`.supervisor` gathers what the ranks report and
decides, :mod:`.launch` runs one launch end to end, of a rank group from its group spec, reporting
to the observers of :mod:`.observer`), shows progress (:mod:`.console`, one observer), turns
failures and hangs into verdicts (:mod:`.diagnose`, torch's own ``ProcessFailure`` reading the
ranks' error files; :mod:`.watchdog`) and writes ``run.json`` (:mod:`.manifest`). Many jobs on one
group: :mod:`.batch`, with the bookkeeping it shares with the server in :mod:`.job_book`. The
server (``wan_s2v_runner.serve``) runs its groups through :mod:`.launch`; nothing here imports it.

Nothing here imports torch at start-up: ``wan-s2v --help`` and preflight's refusals come before
any heavy import (``tests/test_imports.py`` checks it in a fresh interpreter).

May import: shared, preflight, demo, loading.
"""
