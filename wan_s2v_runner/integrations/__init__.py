"""Clients of a wan-s2v server for other programs: the live sessions' client (``session_client``),
the engine of the voice-agent plugins. Nothing here imports the ranks, the launcher or the server's
internals: only the HTTP API and the shared readers of what it sends.

May import: shared.
"""
