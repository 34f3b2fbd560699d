"""Small network helpers shared by launchers, the trainer and test fixtures."""

from __future__ import annotations

import random
import socket

# Ports handed to a server that starts later are drawn from here, below Linux's ephemeral range
# (32768-60999 by default), so that no outgoing connection or srun I/O socket, which the kernel
# places in the ephemeral range, can take the port in between (one CI-equivalent run lost a
# het-job engine that way: srun had bound the test's port by the time the engine started).
# The range avoids the ports this project uses itself: the local Slurm cluster (16800-17100),
# the SGLang stand-in's rendezvous (20000) and SGLang's default (30000).
PICK_RANGE = (21000, 30000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a rendezvous or a server started next)."""
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(*PICK_RANGE)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # the whole range busy: the kernel's pick (ephemeral) is still free now
        s.bind((host, 0))
        return s.getsockname()[1]
