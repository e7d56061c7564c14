"""``wan-s2v serve``: a resident rank group behind an HTTP API (the user's process, node 0), and
its terminal client. It drives its rank groups through the launcher (:mod:`.keeper`); the
launcher knows nothing of it.

- :mod:`.store`: the job stores the API and keepers share (one interface,
  :class:`~.store.protocol.JobStore`; one server's SQLite file; the PostgreSQL queue servers
  share, with leases and fencing; one contract suite for both);
- :mod:`.settings`: the server's own settings, typed (:class:`~.settings.ServerSettings`);
- :mod:`.fleet`: the fleet's identity (one model per pool) and its shared directory's marker;
- :mod:`.watch`: what the server knows of its queue and shared directory between requests;
- :mod:`.dirs`: where a server keeps things, and each attempt's own folder for a job's files;
- :mod:`.group`: the only door to a rank group (:class:`~.group.GroupClient`: submit, cancel,
  renew, release, events, stop, halt) and its one implementation, the launcher on a thread of
  its own (:class:`~.group.LaunchedGroup`);
- :mod:`.keeper`: the thread that owns one rank group, on its own clock: starts it
  (every mode and layout ``run`` supports) from its group spec, claims queued
  jobs one at a time, holds them (leases, fencing), follows their progress from the ranks'
  events (:mod:`.progress`), records what became of each, restarts the group after a failure;
- :mod:`.holds`: what a keeper holds and owes the store (leases it is sure of, owed ends);
- :mod:`.leftovers`: what a killed server's groups left running, found and stopped at start;
- :mod:`.submissions`: a job submission, validated as a job spec on the server's group by the same
  rules and preflight as ``run``, with the path and upload rules;
- :mod:`.protocol`: the typed response models (video object, list, error, server state);
- :mod:`.state`: the server's state (:class:`~.state.Server`) and the views the routes return;
- :mod:`.routes`: the thin routes (OpenAI-style ``/v1/videos``, server-sent progress,
  ``/health``, ``/v1/server``, ``/metrics``, the page at ``/``);
- :mod:`.app`: the FastAPI application: the routes over the state, refusals as error bodies;
- :mod:`.listener`: the HTTP launcher (address check, socket, uvicorn, signals, stopping the group);
- :mod:`.metrics`: ``/metrics`` (Prometheus, through ``prometheus_client``);
- :mod:`.page`: the status page's HTML, CSS and JavaScript (shipped in the package);
- :mod:`.start`: the command's start (the group checked, then serve or compute);
- :mod:`.client`: the terminal client of a server (``wan-s2v submit``, ``wan-s2v jobs``).

May import: shared, launcher, preflight, loading.
"""
