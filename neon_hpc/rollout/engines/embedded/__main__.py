"""``python -m neon_hpc.rollout.engines.embedded``: ``neon-hpc engine serve``."""

import sys

from neon_hpc.rollout.engines.embedded.launcher import main

sys.exit(main())
