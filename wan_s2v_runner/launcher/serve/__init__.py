"""``wan-s2v serve``: a resident rank group behind an HTTP API (launcher side, node 0).

- :mod:`.queue`: the durable job queue (SQLite in WAL mode in the server's directory);
- :mod:`.keeper`: the thread that owns the rank group: launches it (every mode and layout ``run``
  supports) with an inbox, posts queued jobs one at a time, follows their progress from the
  ranks' events, records what became of each, restarts the group after a failure;
- :mod:`.requests`: a job submission, validated by the same rules and preflight as ``run``
  (fields generated from the run spec's job fields), with the path and upload rules;
- :mod:`.app`: the FastAPI application (OpenAI-style ``/v1/videos`` routes, server-sent
  progress, ``/health``, ``/v1/server``, ``/metrics``, the page at ``/``) and
  :func:`.app.run_server`;
- :mod:`.metrics`: ``/metrics`` (Prometheus, through ``prometheus_client``);
- :mod:`.page`: the status page's HTML, CSS and JavaScript (shipped in the package);
- :mod:`.setup`: the command's start (the group checked, then serve or compute).

Part of the launcher: it may import what the launcher may.
"""
