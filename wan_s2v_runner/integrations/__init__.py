"""Clients of a wan-s2v server for other programs: the live sessions' client (``session_client``);
the voice-agent plugins (``pipecat_service``, ``livekit_avatar``) on one engine (``avatar_feed``: a
session's speech in and media out; ``playout``, pure: the agent's own audio placed where the lips
are). Nothing here imports the ranks, the launcher or the server's
internals: only the HTTP API and the shared readers of what it sends.

May import: shared.
"""
