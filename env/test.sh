#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite. The suite starts the
# local Slurm cluster itself (tests/conftest.py) when a test needs it, and stops what it started.
#   bash env/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/env/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
