"""Ports for the tests that must name one before a process binds it (a static rendezvous every
node dials, a PostgreSQL cluster, a server's two nodes): never one the OS hands out by itself.

The usual "free port" (bind port 0, read it, close) lies in the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which the OS hands to any process's next bind to
port 0 and to every outgoing connection's local end: between the test's pick and its process's
bind another process could take it, as it once did (the never-joining node was refused at
preflight: "--master-port N is already in use"). :func:`named_port` picks below that range, where
the OS hands out nothing: only a process that names a port takes it, and each test names its own
(picked at random among thousands, checked free by a bind; the tests' rendezvous without a port
bind port 0 and land in the ephemeral range).
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

#: how far below the ephemeral range the ports are picked
SPAN = 12000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def named_port() -> int:
    """A port below the ephemeral range, free on 127.0.0.1 now (a bind to it succeeded)."""
    low = _ephemeral_low()
    pick = random.Random()  # seeded from the OS: the xdist workers pick apart
    for _ in range(500):
        port = pick.randrange(max(1024, low - SPAN), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{max(1024, low - SPAN)}, {low})")
