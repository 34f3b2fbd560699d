#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian/Ubuntu machine (laptop, CI, a login node you own):
#   1. Debian packages for a real single-machine Slurm cluster (+ accounting), HDF5 tools and the
#      PostgreSQL server (the tests run the XRD system of record on it);
#   2. the virtualenv .venv with neon-hpc and its pinned dependencies.
# Safe to run twice: it skips what is already there.
#
#   bash env/setup.sh            # everything
#   NEON_SKIP_APT=1 bash env/setup.sh   # venv only (e.g. on a cluster login node)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${NEON_PYTHON:-python3}"
VENV="${NEON_VENV:-$ROOT/.venv}"
log() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }

# postgresql: the server the tests start a throwaway cluster of (tests/pgcluster.py); not started here
APT_PKGS=(slurmctld slurmd slurm-client munge libpmix2 slurmdbd mariadb-server hdf5-tools postgresql)

if [[ -z "${NEON_SKIP_APT:-}" ]]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    log "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    # policy-rc.d keeps the packages from starting their own daemons: env/cluster.sh starts them.
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "Debian packages present"
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
# torch first and pinned: the CPU build of 2.13.0 is what this set-up expects; an unpinned
# torch (or one pulled in by another package) is a multi-GB CUDA build.
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  log "installing torch==2.13.0"
  "$VENV/bin/pip" install -q "torch==2.13.0"
fi
# SGLang's wheel, for its request types only (tests/unit/rollout/test_engine_sglang_types.py reads
# GenerateReqInput & co. from its source): SGLang cannot be imported here (its io_struct pulls
# in triton, a matching torchvision and its GPU scheduler), so it is downloaded, not installed.
SGLANG_WHEEL_DIR="$ROOT/.cache/wheels"
if ! ls "$SGLANG_WHEEL_DIR"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  log "downloading sglang==0.5.23 (no deps; source of its request types for the tests)"
  "$VENV/bin/pip" download -q --no-deps -d "$SGLANG_WHEEL_DIR" "sglang==0.5.23"
fi
log "installing neon-hpc (editable) and its dependencies"
"$VENV/bin/pip" install -q -e "$ROOT[all,test]"
# Every module of the package imports in this venv, which pyproject.toml alone made on a fresh
# machine (CI clones afresh, so .venv is new there): an undeclared dependency fails here.
"$VENV/bin/python" - <<'PY'
import importlib, pkgutil, warnings
warnings.simplefilter("ignore")
import neon_hpc, torch
failed = []
for m in pkgutil.walk_packages(neon_hpc.__path__, "neon_hpc."):
    try:
        importlib.import_module(m.name)
    except Exception as e:  # report every module, then fail
        failed.append(f"{m.name}: {type(e).__name__}: {e}")
if failed:
    raise SystemExit("modules that do not import from this venv:\n  " + "\n  ".join(failed))
print("neon-hpc", neon_hpc.__version__, "torch", torch.__version__, "- every module imports")
PY
log "done. Activate with: source $VENV/bin/activate"
