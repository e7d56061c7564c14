"""Rank side: the code a node's ranks run. :mod:`.agent` is the node's parent process (torch
elastic's agent, as torchrun runs it): it imports torch and the engine once, then forks the ranks;
each runs :mod:`.worker`'s ``rank_main(SPEC_JSON)`` (or that of the module ``$WAN_S2V_RANK_WORKER``
names); it joins the process group, loads the parts
its plan needs (:mod:`.parallel` says who does what on the (cfg, sp) mesh), runs our S2V loop
(:mod:`.generation`) and, on rank 0, writes the mp4; a job's own error (its inputs unreadable
when it starts, rank 0's writing) fails that job alone and the ranks take the next.
:mod:`.cpu_binding` pins CPU ranks. The tests' fault injection and engine-free stub rank
are worker modules of their own (``tests/fault_worker.py``, ``tests/stub_rank.py``), not here.

The rank side reports through event files (:mod:`wan_s2v_runner.shared.events`), never through
the launcher's console.

May import: shared, loading, vae_split, runners, patches.
"""
