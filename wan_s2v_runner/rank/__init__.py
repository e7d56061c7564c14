"""Rank side: the code each process torchrun spawns runs. :mod:`.worker` is the entry point
(``python -m wan_s2v_runner.rank.worker SPEC_JSON``); it joins the process group, loads the parts
its plan needs (:mod:`.parallel` says who does what on the (cfg, sp) mesh), runs our S2V loop
(:mod:`.generation`) and, on rank 0, writes the mp4; a job's own error (its inputs unreadable
when it starts, rank 0's writing) fails that job alone and the ranks take the next.
:mod:`.faults` injects failures for the supervision tests (and runs the tests' stub rank in place
of the engine); :mod:`.cpu_binding` pins CPU ranks.

The rank side reports through event files (:mod:`wan_s2v_runner.shared.events`), never through
the launcher's console.

May import: shared, loading, vae_split, runners, patches.
"""
