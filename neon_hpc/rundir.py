"""Compatibility name: the run directory's paths and atomic publish now live in
:mod:`neon_hpc.protocol.rundir` (the contract: ``neon_hpc/protocol/README.md``).

Kept because some fifty modules and tests import the atomic-publish helpers from here;
new code imports :mod:`neon_hpc.protocol`.
"""

from neon_hpc.protocol.rundir import *  # noqa: F401,F403
from neon_hpc.protocol.rundir import (LOW_SPACE_BYTES, STORAGE_ERRNOS, RunDir, RunDirError,  # noqa: F401
                                      StorageError, atomic_file, atomic_write_bytes, atomic_write_json,
                                      atomic_write_text, fsync_dir, fsync_tree, inside, publish_dir,
                                      read_json, remove_stale_tmp, staging_dir_for, storage_error)
