"""``wan-s2v serve``'s HTTP launcher: the address check, the socket, uvicorn, the signals, and
what a stopping server must leave stopped (its rank group). The application itself is
:func:`.app.create_app`.

The server binds 127.0.0.1 unless told otherwise; another address needs a token or an explicit
``--insecure-no-auth`` (:func:`~.settings.check_bind`).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading

from wan_s2v_runner.serve.app import create_app
from wan_s2v_runner.serve.dirs import remove_partial_videos
from wan_s2v_runner.serve.keeper import stop_keepers
from wan_s2v_runner.serve.leftovers import group_file, group_files, wait_for_leftovers
from wan_s2v_runner.serve.state import Server
from wan_s2v_runner.shared import atomic, exit_codes

#: the file a started server writes in its directory: its URL and pid (clients and tests read it)
SERVER_FILE = "server.json"
def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(server: Server) -> int:
    """Serve until SIGINT/SIGTERM: the keepers' groups and the watch in the background, uvicorn in
    front; then stop the groups and make sure nothing of them is left running."""
    import uvicorn

    host = server.settings.host
    sock = bind_socket(host, server.settings.port)
    bound = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}"
    # what any group of a killed server left running (a server started with fewer --replicas too),
    # stopped first: nothing of it writes while its jobs' files are cleaned up below
    for note in group_files(server.dirs.root):
        wait_for_leftovers(note)
        note.unlink(missing_ok=True)
    if not server.queue.shared:  # a shared directory's other servers are writing theirs
        remove_partial_videos(server.dirs.videos)
    for job_id in server.queue.job_purge_deleting():  # deleted while they ran, before the server stopped
        server.dirs.remove_job_files(job_id, video=True)
    recovered = server.queue.job_recover()
    if recovered:
        print(f"serve: {len(recovered)} job(s) were in progress when the server stopped; they resume first: "
              f"{', '.join(recovered)}", flush=True)
    # uvicorn handles SIGINT/SIGTERM while it runs and, once it has shut down, restores the
    # handlers it found and raises the signal again: with the default SIGTERM handler that would
    # end this process before the rank group is stopped (a node agent left behind). So the handlers
    # it finds are ours: stop the start-up before uvicorn runs, nothing after it.
    uvicorn_running = threading.Event()

    def on_signal(sig: int, _frame) -> None:
        if not uvicorn_running.is_set():
            raise SystemExit(exit_codes.INTERRUPTED)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.watch.start()
        for keeper in server.keepers:
            keeper.start()
        atomic.write_text(server.dirs.root / SERVER_FILE, json.dumps({"url": url, "pid": os.getpid()}))
        print(f"serve: {url} (POST /v1/videos, GET /health); server directory {server.dirs.root}", flush=True)
        config = uvicorn.Config(create_app(server), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        # what start-up built (torch, from the machine probe; FastAPI; the app) lives as long as the
        # server: out of the collector's sight, so a full collection walks only what requests make
        # (measured: full collections of 70-146 ms in this process stalled a submission to 184-216 ms
        # with 10,000 jobs queued and 10 event streams open; bench/bench_feed.py)
        gc.collect()
        gc.freeze()
        uvicorn_running.set()
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        print("serve: stopping the rank group (a job in progress resumes when the server starts again)",
              file=sys.stderr, flush=True)
        stop_keepers(server.keepers)
        left = [pid for k in server.keepers for pid in wait_for_leftovers(group_file(server.dirs.root, k.index),
                                                                           grace_s=5.0)]
        if left:
            print(f"serve: stopped what the rank group left running (pids {', '.join(map(str, left))})",
                  file=sys.stderr, flush=True)
        (server.dirs.root / SERVER_FILE).unlink(missing_ok=True)
        server.watch.stop()
        for keeper in server.keepers:
            if keeper.queue is not server.queue:
                keeper.queue.close()
        server.queue.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
