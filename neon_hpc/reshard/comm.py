"""The few collectives the converter needs, over MPI when launched under it, else a no-op.

mpi4py is imported only when the environment says an MPI launcher started us (``mpiexec``,
``mpirun`` or ``srun --mpi=pmi2``), so a plain ``python tools/reshard.py`` never loads MPI.
"""

from __future__ import annotations

import os

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMI_FD")


class SerialComm:
    rank, size = 0, 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def barrier(self):
        pass


class MPIComm:
    def __init__(self):
        # deferred: optional (mpi4py: only under an MPI launcher)
        from mpi4py import MPI
        self._c = MPI.COMM_WORLD
        self.rank, self.size = self._c.Get_rank(), self._c.Get_size()

    def bcast(self, obj, root=0):
        return self._c.bcast(obj, root=root)

    def allgather(self, obj):
        return self._c.allgather(obj)

    def barrier(self):
        self._c.Barrier()


def launched_under_mpi() -> bool:
    return any(k in os.environ for k in _MPI_ENV)


def get_comm(use_mpi: bool | None = None):
    """MPI world if launched under MPI (or ``use_mpi=True``), else a single-rank stand-in."""
    if use_mpi is None:
        use_mpi = launched_under_mpi()
    return MPIComm() if use_mpi else SerialComm()
