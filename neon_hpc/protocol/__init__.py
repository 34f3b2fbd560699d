"""The run-directory protocol: the one contract between the roles (``README.md`` here).

* :mod:`neon_hpc.protocol.rundir`: every path of the run directory and the atomic publish;
* :mod:`neon_hpc.protocol.records`: the typed records and their read and write functions;
* :mod:`neon_hpc.protocol.admission`: the admission rule (worker and simulator);
* :mod:`neon_hpc.config.protocol`: the ``protocol`` config section (poll intervals);
* ``python -m neon_hpc.protocol``: the same for shell scripts (the sbatch body).

Imports nothing of the roles; only the standard library, pydantic and :mod:`neon_hpc.util.constraints`.
"""

from neon_hpc.protocol.records import (  # noqa: F401
    ClaimOwner,
    ClaimRecord,
    DroppedRecord,
    EngineRecord,
    Finished,
    JobRecord,
    LeaseRecord,
    NodeBeat,
    Preempted,
    Record,
    TrainerBeat,
    TrainerPhase,
    WorkerBeat,
    mark_finished,
)
from neon_hpc.protocol.rundir import RunDir, RunDirError  # noqa: F401
