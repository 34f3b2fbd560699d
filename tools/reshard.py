#!/usr/bin/env python
"""Megatron torch_dist -> HF safetensors.  ``python tools/reshard.py --src CKPT --dst OUT``,
or under MPI: ``mpiexec -n 4 python tools/reshard.py ...``.  See neon_hpc/reshard/README.md."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from neon_hpc.reshard.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
