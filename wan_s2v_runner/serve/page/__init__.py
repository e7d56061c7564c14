"""The status page ``wan-s2v serve`` shows at ``GET /``: plain HTML, CSS and JavaScript files in
this folder, served by the app as they are (no build step, no CDN, nothing fetched from the
internet). The page reads the API like any client: ``/v1/server`` once (the layout and the job
fields with their defaults, from which it builds the submit form), ``/v1/events`` as a live feed
(server-sent events read with ``fetch``, so the bearer token travels in a header, never in a
URL), ``POST /v1/videos`` to submit, ``DELETE`` to cancel, ``/content`` for the player.

Part of the launcher (serve); it imports nothing.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent
INDEX = ROOT / "index.html"
#: the files served under /static/ (nothing else in this folder is)
ASSETS = {"page.js": "text/javascript", "page.css": "text/css"}
