"""Measured figures (``neon-hpc plan --calibrate``): benchmark ``RESULT k=v ...`` lines ->
simulator parameters, with sources.

Every benchmark (``tools/bench_*.py``) ends with one ``RESULT name=value ...`` line.  This
module reads such lines from files (or stdin, ``-``) and maps the keys it understands onto
:class:`~neon_hpc.plan.params.SimParams` fields.  Each applied value records
``RESULT <file>:<line> <key>`` as its source; each key not used is listed with the reason,
so nothing is silently ignored.  A later line overrides an earlier one.

Keys understood:

* any ``SimParams`` field name, verbatim (e.g. a GPU measurement written as
  ``RESULT decode_tokens_per_s=31.5 mfu=0.42``);
* ``gpu_decode_tokens_per_s`` -> ``decode_tokens_per_s``; ``gpu_mfu`` -> ``mfu``;
  ``gpu_bf16_tflops`` / ``gpu_matmul_tflops`` -> ``gpu_flops`` (x 1e12);
* ``replay_cost_per_byte_ns`` -> ``export_bytes_per_s = 1e9 / value``;
* ``kimi_dp_stall_full_s`` + ``kimi_dp_stall_delta_s`` (tools/bench_replay.py) ->
  ``export_bytes_per_s``, by inverting that benchmark's DP-stall model at its default shape
  (8 DP ranks, 32 turns to 65,536 tokens, 61 layers, top-8): the two equations
  ``full = 32*fixed + c*M`` and ``delta = 32*fixed + c*32`` (``M`` = the summed slowest
  turn index of its seeded phases) give the per-byte cost ``c``;
* ``reshard_bytes_per_s`` (per rank) -> ``publish_bytes_per_s`` x trainer nodes (one
  converter rank per node).
"""
from __future__ import annotations

import dataclasses
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from neon_hpc.plan.params import SimParams, Sourced

ALIASES = {
    "gpu_decode_tokens_per_s": ("decode_tokens_per_s", 1.0),
    "gpu_mfu": ("mfu", 1.0),
    "gpu_bf16_tflops": ("gpu_flops", 1e12),
    "gpu_matmul_tflops": ("gpu_flops", 1e12),
}
NOT_INPUTS = {
    "balance_": "a balancer ratio; the simulator runs the balancer itself",
    "plan_": "an output of this planner, not an input",
    "replay_bytes_": "a ratio; bytes per token come from the model config",
    "replay_export_time_": "a ratio; export cost per byte comes from kimi_dp_stall_* or replay_cost_per_byte_ns",
    "reshard_speedup": "a ratio against the serial converter; publish speed needs reshard_bytes_per_s",
    "reshard_": "a reshard ratio; publish speed needs reshard_bytes_per_s",
    "store_": "trajectory-store throughput: far from a bottleneck at these rates, not modelled",
    "batched_tok_s": "aggregate tokens/s of the embedded CPU engine; the simulator needs a per-request decode rate "
                     "(decode_tokens_per_s)",
    "sequential_tok_s": "the embedded engine's one-request baseline; set decode_tokens_per_s for a per-request rate",
    "delta_export_": "a flatness check of the replay benchmark",
    "method_s_": "the balancing method's own wall time; the simulator runs the balancer itself",
    "method_cpu_s_": "the balancing method's own CPU time; the simulator runs the balancer itself",
    "speedup": "a ratio of the embedded engine's batched vs sequential throughput",
    "max_batch": "the embedded engine's batch size in its benchmark",
}


@dataclass
class ResultLine:
    where: str            # "file:line"
    values: dict[str, float]
    raw: dict[str, str]


@dataclass
class Calibration:
    applied: list[tuple[str, float, str]] = field(default_factory=list)     # (param, value, source)
    unused: list[tuple[str, str, str]] = field(default_factory=list)        # (key, where, why)

    def lines(self) -> list[str]:
        out = [f"  {p:<24} = {v:<12.4g} <- {src}" for p, v, src in self.applied]
        out += [f"  (not used) {k} from {w}: {why}" for k, w, why in self.unused]
        return out


def parse_results(text: str, name: str) -> list[ResultLine]:
    """All ``RESULT k=v ...`` lines of a benchmark's output (other lines ignored)."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line.startswith("RESULT "):
            continue
        raw, values = {}, {}
        for item in line.split()[1:]:
            if "=" not in item:
                continue
            k, v = item.split("=", 1)
            raw[k] = v
            try:
                values[k] = float(v)
            except ValueError:
                pass
        out.append(ResultLine(f"{name}:{no}", values, raw))
    return out


def read_results(paths: list[str]) -> list[ResultLine]:
    lines = []
    for path in paths:
        if path == "-":
            lines += parse_results(sys.stdin.read(), "<stdin>")
            continue
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise FileNotFoundError(f"--calibrate {path}: cannot read it ({e.strerror}); pass the saved output "
                                    f"of a tools/bench_*.py run, or - for stdin") from None
        found = parse_results(text, path)
        if not found:
            raise ValueError(f"--calibrate {path}: no 'RESULT k=v ...' line in it; save a benchmark's full output "
                             f"(e.g. python tools/bench_replay.py | tee replay.txt)")
        lines += found
    return lines


def apply(sourced: Sourced, lines: list[ResultLine]) -> Calibration:
    """Set every parameter the RESULT lines measure; report what was used and what not."""
    cal = Calibration()
    fields = {f.name for f in dataclasses.fields(SimParams)}
    for rl in lines:
        used: set[str] = set()
        _apply_derived(sourced, rl, cal, used)
        for key, value in rl.values.items():
            if key in used:
                continue
            src = f"RESULT {rl.where} {key}"
            if key in fields and isinstance(getattr(sourced.params, key), (int, float)) \
                    and not isinstance(getattr(sourced.params, key), bool):
                typ = type(getattr(sourced.params, key))
                _set(sourced, cal, key, typ(value), src)
            elif key in ALIASES:
                param, scale = ALIASES[key]
                _set(sourced, cal, param, value * scale, src)
            else:
                why = next((w for prefix, w in NOT_INPUTS.items() if key.startswith(prefix)),
                           "no simulator parameter measured by this key")
                cal.unused.append((key, rl.where, why))
        for key, raw in rl.raw.items():
            if key not in rl.values:
                cal.unused.append((key, rl.where, f"not a number ({raw!r})"))
    return cal


def _set(sourced: Sourced, cal: Calibration, param: str, value: float, src: str) -> None:
    if not math.isfinite(value) or value <= 0:
        cal.unused.append((param, src, f"not a positive finite value ({value})"))
        return
    sourced.set(param, value, src)
    cal.applied.append((param, value, src))


def _apply_derived(sourced: Sourced, rl: ResultLine, cal: Calibration, used: set[str]) -> None:
    v = rl.values
    if "replay_cost_per_byte_ns" in v:
        used.add("replay_cost_per_byte_ns")
        if v["replay_cost_per_byte_ns"] > 0:
            _set(sourced, cal, "export_bytes_per_s", 1e9 / v["replay_cost_per_byte_ns"],
                 f"RESULT {rl.where} replay_cost_per_byte_ns")
    elif "kimi_dp_stall_full_s" in v and "kimi_dp_stall_delta_s" in v:
        used.update(("kimi_dp_stall_full_s", "kimi_dp_stall_delta_s"))
        per_byte = invert_replay_stall(v["kimi_dp_stall_full_s"], v["kimi_dp_stall_delta_s"])
        if per_byte > 0:
            _set(sourced, cal, "export_bytes_per_s", 1.0 / per_byte,
                 f"RESULT {rl.where} kimi_dp_stall_full_s,kimi_dp_stall_delta_s (inverted at bench_replay's "
                 f"default shape)")
    if "reshard_bytes_per_s" in v:
        used.add("reshard_bytes_per_s")
        nodes = max(1, sourced.params.train_gpus // max(sourced.params.gpus_per_node, 1))
        _set(sourced, cal, "publish_bytes_per_s", v["reshard_bytes_per_s"] * nodes,
             f"RESULT {rl.where} reshard_bytes_per_s x {nodes} trainer nodes")


def invert_replay_stall(full_s: float, delta_s: float, ranks: int = 8, turns: int = 32,
                        context: int = 65536, layers: int = 61, topk: int = 8) -> float:
    """Seconds per wire byte from tools/bench_replay.py's two DP-stall figures (its model:
    seeded random phases, each lockstep turn waits for the slowest rank's export)."""
    rnd = random.Random(0)
    phases = [rnd.randrange(turns) for _ in range(ranks)]
    slowest = sum(max((ph + step) % turns + 1 for ph in phases) for step in range(turns))
    row_bytes = layers * topk * 4 * 4 / 3
    per_turn = context // turns
    denom = row_bytes * per_turn * (slowest - turns)
    return (full_s - delta_s) / denom if denom > 0 else 0.0
