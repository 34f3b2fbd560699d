"""Small network helpers shared by launchers, the trainer and test fixtures."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a rendezvous or a server started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
