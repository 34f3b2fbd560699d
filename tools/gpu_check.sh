#!/usr/bin/env bash
# One prepared device check for the trainer (issue 40, item 9): what a lent GPU runs in about
# eight minutes, everything written under $OUT (at most 6 files: the device tool returns 8).
#
#   OUT=/some/dir tools/gpu_check.sh          # on the device machine, from the repository root
#
# Steps, each bounded by `timeout` (seconds), in the order of what they are worth:
#   tests    (90)  pytest -m cuda: the CUDA-only paths (tests/test_train_cuda.py)
#   sdpa     (60)  the piece attention at the trainer's strides and lengths (n - 1 tokens, V a view
#                  of the fused QKV, GQA 16/4 d128 and MLA 192/128) against the math kernel
#   profile  (60)  one profiled trainer step at 4 x 4096: kernels, host syncs, memcpys
#   bench   (300)  tools/bench_train_gpu.py at 4 x 4096, 1 x 32768 and 1 x 65536 (its RESULT line)
# Files: env.txt, gpu_check.log (every step's output), summary.txt (rc per step + RESULT),
# sdpa_parity.json, profile_4x4096.json, trace_4x4096.json.gz (dropped when over 15 MB).
# What must travel (neon_hpc/train/README.md, "On a lent GPU"): .whl/ with megatron-core 0.16.1
# and what the device image lacks; they are installed into /tmp/site here.
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
LOG=$OUT/gpu_check.log
{ nvidia-smi; $PY -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"; \
  $PY -c "import megatron.core, neon_hpc.train.loop; print('megatron-core', megatron.core.__version__)"; } > "$OUT/env.txt" 2>&1

step() {
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt" "$LOG"
}

step tests 90 $PY -m pytest -q -m cuda -p no:cacheprovider $(find tests -name "test_train_cuda.py")
step sdpa 60 $PY tools/gpu_probe.py sdpa --out "$OUT" --lengths 4096,32768
step profile 60 $PY tools/gpu_probe.py profile --out "$OUT" --shape 4x4096
step bench 300 $PY tools/bench_train_gpu.py --device cuda --shapes 4x4096,1x32768,1x65536 \
    --memory-lengths 8192,16384 --max-doc 65536
grep '^RESULT' "$LOG" >> "$OUT/summary.txt"
if [ -f "$OUT/trace_4x4096.json" ]; then
    gzip -f "$OUT/trace_4x4096.json"
    [ "$(stat -c %s "$OUT/trace_4x4096.json.gz")" -gt 15000000 ] && rm -f "$OUT/trace_4x4096.json.gz"
fi
cat "$OUT/summary.txt"
