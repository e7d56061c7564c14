"""Names the launcher and a node's agent share (:mod:`wan_s2v_runner.rank.agent`): the agent's
module (every rank is forked from it and keeps its command line, so the launcher finds a run's
processes in ``/proc`` by it and the run's ``spec.json``), the rank body it runs unless told
another, and the rendezvous port of a multi-node run when none is given. Imports nothing."""
from __future__ import annotations

#: the module every node's agent runs (``python -m``), the ranks' command line too
AGENT_MODULE = "wan_s2v_runner.rank.agent"
#: the module whose ``rank_main(spec_path)`` a rank runs unless the launcher names another
DEFAULT_WORKER = "wan_s2v_runner.rank.worker"
#: rendezvous port of a multi-node run when none is given (torchrun's own default)
DEFAULT_MASTER_PORT = 29500
