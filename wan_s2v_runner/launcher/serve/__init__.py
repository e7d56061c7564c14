"""``wan-s2v serve``: a resident rank group behind an HTTP API (launcher side, node 0).

- :mod:`.queue`: the job store the API and keepers share (:class:`~.queue.JobStore`) and its
  durable SQLite queue (WAL mode, in the server's directory);
- :mod:`.keeper`: the thread that owns one rank group (an observer of its run): launches it
  (every mode and layout ``run`` supports) from its group spec with an inbox, posts queued
  jobs one at a time, follows their progress from the ranks' events, records what became of
  each, restarts the group after a failure;
- :mod:`.requests`: a job submission, validated as a job spec on the server's group by the same
  rules and preflight as ``run``, with the path and upload rules;
- :mod:`.protocol`: the typed response models (video object, list, error, server state);
- :mod:`.state`: the server's state (:class:`~.state.Server`) and the views the routes return;
- :mod:`.routes`: the thin routes (OpenAI-style ``/v1/videos``, server-sent progress,
  ``/health``, ``/v1/server``, ``/metrics``, the page at ``/``);
- :mod:`.app`: the FastAPI application: the routes over the state, refusals as error bodies;
- :mod:`.http`: the HTTP launcher (address check, socket, uvicorn, signals, stopping the group);
- :mod:`.metrics`: ``/metrics`` (Prometheus, through ``prometheus_client``);
- :mod:`.page`: the status page's HTML, CSS and JavaScript (shipped in the package);
- :mod:`.setup`: the command's start (the group checked, then serve or compute).

Part of the launcher: it may import what the launcher may.
"""
