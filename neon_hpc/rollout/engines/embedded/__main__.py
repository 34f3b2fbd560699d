"""``python -m neon_hpc.rollout.engines.embedded``: ``neon-hpc engine serve``."""

import sys

from neon_hpc.rollout.engines.embedded.launcher import main

if __name__ == "__main__":   # importing the module (env/setup.sh checks every one) runs nothing
    sys.exit(main())
