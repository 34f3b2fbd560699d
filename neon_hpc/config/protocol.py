"""The ``protocol`` section of the experiment config: how often the roles poll the run directory.

No role waits on another through a socket, a lock or inotify: each polls the records of the
run directory (``neon_hpc/protocol/README.md``).  These intervals are the whole timing of that
protocol; the roles read them from here, and the simulator's validation
(``python -m neon_hpc.plan.validate``) models the same numbers from the run's ``run.yaml``.
"""
from dataclasses import dataclass

from neon_hpc.util.constraints import Rule, above, section


@section
@dataclass
class ProtocolConfig:
    # a refused rollout worker re-checks admission this often, watching only the trainer's beat
    # and its node's engine record (two small files) ...
    admission_poll_s: float = 0.25
    # ... and re-reads everything (every worker's beat, ready/) at least this often
    admission_recheck_s: float = 5.0
    # a rollout worker in a long group re-beats this often ...
    worker_heartbeat_s: float = 10.0
    # ... and admission ignores a worker beat older than this (a dead worker's in-flight count)
    heartbeat_expiry_s: float = 60.0
    # the rollout node checks weights/LATEST (and its workers and engines) this often
    weight_poll_s: float = 0.5
    # a trainer waiting for data looks at trajectories/ready/ this often
    claim_poll_s: float = 0.2

    CHECKS = {k: above(0, note="seconds") for k in ("admission_poll_s", "admission_recheck_s",
                                                    "worker_heartbeat_s", "heartbeat_expiry_s",
                                                    "weight_poll_s", "claim_poll_s")}
    RULES = (
        Rule("heartbeat_expiry_s", lambda c: c.heartbeat_expiry_s > 2 * c.worker_heartbeat_s,
             lambda c: f"more than twice worker_heartbeat_s ({2 * c.worker_heartbeat_s:g}): a live worker "
                       f"busy in a long group would look dead to admission between its beats"),
        Rule("admission_recheck_s", lambda c: c.admission_recheck_s >= c.admission_poll_s,
             "at least admission_poll_s ({admission_poll_s}): the full re-read happens on a poll"),
    )
