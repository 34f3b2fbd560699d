"""The trainer's own step, timed and its memory measured: what ``neon-hpc costfit`` runs.

:class:`TrainerStepRunner` is one trainer rank (world 1, TP = EP = PP = 1) on this machine's
device (CUDA when available, else CPU): ``backend.setup`` builds the megatron-core model, DDP
and optimizer as the trainer does, and every :meth:`~TrainerStepRunner.step` is one
``loop.train_step`` on a micro-batch the caller chooses (documents ``[(start, end), ...]`` of
synthetic trajectories): zero the grads, build the packed micro-batch, forward + backward
through megatron's schedule, finalize the grads, the optimizer step.  The balancing part of
``loop.prepare_step`` is skipped on purpose (the calibration chooses the micro-batch; the
balancer would re-pack it).

What one step reports (:class:`StepMeasure`):

* ``microbatch_s``: from the step's start to the entry of ``finalize_grads`` (zero grads,
  micro-batch build, forward and backward), the part the cost model's per-micro-batch terms
  describe; ``step_s``: the whole ``train_step``; ``step_s - microbatch_s`` is the per-step
  part (grad finalize, optimizer).  The boundary is read by wrapping this runner's own
  ``Backend.finalize_grads`` (on CUDA after ``torch.cuda.synchronize()``, so queued backward
  kernels count in the micro-batch).  Clock: ``cpu`` (process CPU time: robust on a shared
  CPU machine) or ``wall``; on CUDA always ``wall`` (CPU time does not see the GPU).
* ``peak_bytes``: the step's peak memory above what was held before it.  CUDA:
  ``torch.cuda.max_memory_allocated()`` (peak reset before the step) minus
  ``memory_allocated()`` before it: tensors only, not the caching allocator's reserve.  CPU:
  the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) minus
  its resident set before the step, with glibc mapping every allocation of 64 KiB or more on
  its own (``train.heap.PeakMemory``) and ``malloc_trim(0)`` before the step, so the resident set
  follows the tensors alive.  It still counts what the OS charges: whole pages, small
  allocations in the arenas, the step's non-tensor memory; so the memory fit uses the longer
  lengths, where tensors dominate.

The trainer's ``train.precision`` and ``train.recompute`` are passed to ``backend.setup``
(:func:`setup_extras`), so the step is measured as the trainer runs it; the cost file records both.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Sequence

import numpy as np

from neon_hpc.train.corrections import bind
from neon_hpc.train.heap import PeakMemory, mmap_large_allocations
from neon_hpc.util.netutil import free_port


@dataclass
class StepMeasure:
    microbatch_s: float          # zero grads + micro-batch build + forward + backward
    step_s: float                # the whole train_step (+ finalize grads + optimizer)
    peak_bytes: float            # peak memory above the step's starting point


def setup_extras(train_cfg: Any) -> dict[str, Any]:
    """``backend.setup`` keyword arguments of the config's ``train.precision`` / ``train.recompute``:
    the step is measured as the trainer will run it."""
    return {"precision": train_cfg.precision, "recompute": train_cfg.recompute}


def synthetic_trajectories(lengths: Sequence[int], vocab: int, seed: int = 0) -> list:
    """One trajectory per document of ``n`` input tokens (``n + 1`` tokens, a short prompt, the
    rest generated), advantages +-1 so every step has a real gradient."""
    from neon_hpc.store import Trajectory  # deferred: heavy (neon_hpc.store: h5py, pydantic)
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        total = int(n) + 1
        prompt = min(8, total // 2)
        mask = np.r_[np.zeros(prompt), np.ones(total - prompt)].astype(np.uint8)
        t = Trajectory(tokens=rng.integers(0, vocab, total).astype(np.int32), loss_mask=mask,
                       logprobs=np.where(mask > 0, -5.0, 0).astype(np.float32),
                       versions=np.where(mask > 0, 0, -1).astype(np.int32), reward=float(i % 2),
                       task_id=f"calibration{i}", group_id="calibration")
        t.advantage = 1.0 if i % 2 == 0 else -1.0
        out.append(t)
    return out


class TrainerStepRunner:
    """One trainer rank's real step on this machine's device (module docstring)."""

    def __init__(self, cfg: Any, clock: str = "cpu", threads: int = 1, seed: int = 0) -> None:
        import torch  # deferred: heavy (torch)

        from neon_hpc.train import backend as B  # deferred: heavy (neon_hpc.train.backend: torch, pydantic)
        from neon_hpc.train.loop import _select_device, dist_env  # deferred: heavy (neon_hpc.train.loop: torch, h5py)

        if clock not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
        self.cuda = torch.cuda.is_available()
        self.clock = "wall" if self.cuda else clock
        if not self.cuda:
            torch.set_num_threads(threads)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            os.environ["MASTER_ADDR"] = "127.0.0.1"      # a fresh rendezvous per runner: one may follow another
            os.environ["MASTER_PORT"] = str(free_port())
        _rank, world, local = dist_env()
        if world != 1:
            raise ValueError(f"calibration runs one trainer rank; WORLD_SIZE={world} is set: unset it")
        _select_device(local)
        self.model_cfg, self.train_cfg = cfg.model, cfg.train
        self.extras = setup_extras(cfg.train)
        self.be = B.setup(cfg.model, tp=1, ep=1, pp=1, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                          grad_clip=cfg.train.grad_clip, replay=False, seed=cfg.train.seed, **self.extras)
        self.lcfg = dict(clip_eps=cfg.train.clip_eps, kl_coef=0.0, correction=bind("none"))
        self.seed = seed
        self.step_overheads: list[float] = []
        self._mark: list[float] = []
        finalize = self.be.finalize_grads

        def timed_finalize():                 # the micro-batch / per-step boundary (module docstring)
            self._sync()
            self._mark.append(self._now())
            return finalize()
        self.be.finalize_grads = timed_finalize
        self._peak = None                # created by the first memory step (it changes malloc on CPU)

    # ---- clocks and memory ------------------------------------------------------------
    def _sync(self) -> None:
        if self.cuda:
            import torch  # deferred: heavy (torch)
            torch.cuda.synchronize()

    def _now(self) -> float:
        return time.process_time() if self.clock == "cpu" else time.perf_counter()

    def _mem_start(self) -> float:
        if self._peak is None:
            self._peak = PeakMemory(self.cuda, mmap_large=True)
        return float(self._peak.start())

    def _mem_peak(self) -> float:
        return float(self._peak.stop())

    # ---- steps --------------------------------------------------------------------------
    def step(self, pieces: Sequence[tuple[int, int]], memory: bool = False) -> StepMeasure:
        """One ``train_step`` on one micro-batch of whole documents ``[(0, n), ...]``."""
        from neon_hpc.train.loop import StepData, train_step  # deferred: heavy (neon_hpc.train.loop: torch, h5py)
        if any(s != 0 for s, _ in pieces):
            raise ValueError("the trainer's calibration step runs whole documents [(0, n), ...]: a piece that "
                             "starts later needs the ranks that hold its prefix (one rank here)")
        lengths = [int(e) for _, e in pieces]
        limit = self.model_cfg.max_position_embeddings
        if max(lengths) > limit:
            raise ValueError(f"a {max(lengths)}-token document is longer than model.max_position_embeddings="
                             f"{limit}; calibrate lengths up to it, or raise it")
        trajs = synthetic_trajectories(lengths, self.model_cfg.vocab_size, self.seed)
        pieces = [[[(i, 0, n) for i, n in enumerate(lengths)]]]
        tokens = int(sum(int(np.count_nonzero(t.loss_mask[1:])) for t in trajs))
        data = StepData(trajs, np.array([t.advantage for t in trajs]), pieces, "calibration", tokens)
        base = self._mem_start() if memory else 0.0
        self._mark.clear()
        self._sync()
        t0 = self._now()
        train_step(self.be, data, self.lcfg)
        self._sync()
        t1 = self._now()
        peak = self._mem_peak() - base if memory else 0.0
        if len(self._mark) != 1:
            raise RuntimeError(f"train_step called finalize_grads {len(self._mark)} times (expected once): the "
                               f"micro-batch / optimizer boundary of the calibration is lost")
        return StepMeasure(microbatch_s=self._mark[0] - t0, step_s=t1 - t0, peak_bytes=peak)

    def best_of(self, pieces: Sequence[tuple[int, int]], repeats: int) -> float:
        """The fastest of ``repeats`` steps' micro-batch time (``costfit.fit``'s runner interface);
        each step's per-step part (finalize + optimizer) goes to ``step_overheads``."""
        runs = [self.step(pieces) for _ in range(max(1, repeats))]
        self.step_overheads.extend(r.step_s - r.microbatch_s for r in runs)
        return min(r.microbatch_s for r in runs)

    can_split = False            # one rank: a late chunk's prefix lives on no other rank

    def describe(self) -> dict[str, Any]:
        """Device, torch, precision and the kernels the step ran, for the cost file."""
        import torch  # deferred: heavy (torch)
        model = self.be.models[0]
        dtype = next(model.parameters()).dtype
        d: dict[str, Any] = {
            "runner": "trainer step (neon_hpc.train.costfit.step: backend.setup + loop.train_step, world 1)",
            "device": (torch.cuda.get_device_name() if self.cuda
                       else f"cpu ({platform.processor() or platform.machine()})"),
            "device_type": "cuda" if self.cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda if self.cuda else None,
            "megatron_core": _version("megatron-core"), "platform": platform.platform(),
            "clock": self.clock, "torch_threads": torch.get_num_threads(),
            "param_dtype": str(dtype).replace("torch.", ""),
            "precision": self.extras.get("precision", "fp32 (backend.setup builds fp32 parameters and optimizer)"),
            "recompute": self.extras.get("recompute", "none"),
            "kernels": kernels(model),
            "memory_method": ("torch.cuda.max_memory_allocated() above memory_allocated() before the step" if self.cuda
                              else "peak RSS (VmHWM, reset by /proc/self/clear_refs) above RSS before the step; "
                                   "glibc mmap threshold 64 KiB, malloc_trim(0) before"),
        }
        return d

    def element_bytes(self) -> int:
        """Bytes of one activation element as this step runs (bf16 -> 2, else 4)."""
        p = self.extras.get("precision", "")
        if p == "bf16":
            return 2
        import torch  # deferred: heavy (torch)
        return 2 if next(self.be.models[0].parameters()).dtype in (torch.bfloat16, torch.float16) else 4

    def close(self) -> None:
        """Tear the process group down and free the model, its grads and optimizer state (on CUDA
        back to the device too: the memory measurement's process runs after this one's)."""

        import torch  # deferred: heavy (torch)

        from neon_hpc.train import backend as B  # deferred: heavy (neon_hpc.train.backend: torch, pydantic)
        B.teardown()
        self.be = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def kernels(model) -> dict[str, Any]:
    """Which implementations the step ran: the core-attention and expert module classes of the
    built model, megatron's grouped-GEMM flag, the optional kernel packages importable here and
    PyTorch's SDPA backends enabled."""

    import torch  # deferred: heavy (torch)
    attn, experts = set(), set()
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "core_attention":
            attn.add(type(mod).__module__ + "." + type(mod).__name__)
        elif leaf == "experts":
            experts.add(type(mod).__module__ + "." + type(mod).__name__)
    cfg = getattr(model, "config", None)
    out = {"core_attention": sorted(attn), "experts": sorted(experts),
           "moe_grouped_gemm": bool(getattr(cfg, "moe_grouped_gemm", False)),
           "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
           "flash_attn": importlib.util.find_spec("flash_attn") is not None}
    if torch.cuda.is_available():
        out["sdpa"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                       "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                       "math": torch.backends.cuda.math_sdp_enabled()}
    return out


def memory_lengths(lengths: Sequence[int], count: int = 4) -> list[int]:
    """The ``count`` longest distinct lengths (RSS deltas of short steps are allocator noise)."""
    return sorted(set(int(n) for n in lengths))[-count:]


def memory_depths(num_layers: int) -> tuple[int, int]:
    """Two depths to tell bytes per layer from bytes outside the layers: the config's and half
    of it (4 layers or more), else twice it (a small model: more leverage than one layer less)."""
    return (num_layers, num_layers // 2) if num_layers >= 4 else (num_layers, 2 * num_layers)


def measure_memory(cfg: Any, lengths: Sequence[int], repeats: int = 2,
                   progress=None) -> tuple[list[tuple[int, int, float]], dict]:
    """Peak memory of single-document steps at two model depths (:func:`memory_depths`).

    Per (depth, length) the smallest of ``repeats`` steps, after one warm-up step at that
    depth (the optimizer's state exists from then on).  Run it in a process that has not
    trained before (:func:`measure_memory_process`): on CPU the arenas an earlier step left
    behind would be reused and counted.  Returns ``([(layers, tokens, peak_bytes)], describe()
    of the config's depth with its ``element_bytes``)``.
    """

    import torch  # deferred: heavy (torch)
    say = progress or (lambda s: None)
    points: list[tuple[int, int, float]] = []
    described: dict = {}
    if not torch.cuda.is_available():
        mmap_large_allocations()          # before the first step: no arena shaped by the default threshold
    for depth in memory_depths(cfg.model.num_layers):
        r = TrainerStepRunner(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=depth)))
        try:
            r.step([(0, min(lengths))])                            # warm-up: optimizer state
            for n in lengths:
                peak = min(r.step([(0, n)], memory=True).peak_bytes for _ in range(max(1, repeats)))
                points.append((depth, int(n), peak))
                say(f"memory: {depth} layer(s), {n} tokens: peak +{peak / 2**20:.1f} MiB")
            if depth == cfg.model.num_layers:
                described = dict(r.describe(), element_bytes=r.element_bytes())
        finally:
            r.close()
    return points, described


def measure_memory_process(config_path: str | None, sets: Sequence[str], lengths: Sequence[int],
                           repeats: int = 2) -> tuple[list[tuple[int, int, float]], dict]:
    """:func:`measure_memory` in a fresh Python process (the config file and ``--set`` overrides
    as the CLI got them); its progress goes to this process's stderr."""
    with tempfile.TemporaryDirectory(prefix="neon_memory_") as tmp:
        out = os.path.join(tmp, "memory.json")
        cmd = [sys.executable, "-m", "neon_hpc.train.costfit.step", "--out", out, "--repeats", str(repeats),
               "--lengths", ",".join(str(int(n)) for n in lengths)]
        cmd += (["--config", config_path] if config_path else []) + [f"--set={s}" for s in sets]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        r = subprocess.run(cmd, env=env, stdout=sys.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"the memory measurement process exited with {r.returncode} (its output is above); "
                               f"pass --no-memory to calibrate without it")
        with open(out) as f:
            data = json.load(f)
    return [tuple(p) for p in data["points"]], data["described"]


def main(argv: list[str] | None = None) -> int:
    """``python -m neon_hpc.train.costfit.step --out F --lengths ... [--config C] [--set k=v]``: the
    memory measurement of :func:`measure_memory_process` (a fresh process)."""

    from neon_hpc import config  # deferred: heavy (neon_hpc.config: h5py, pydantic)
    from neon_hpc.protocol.rundir import atomic_write_json  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
    ap = argparse.ArgumentParser(prog="python -m neon_hpc.train.costfit.step",
                                 description="peak memory of the trainer's step at two depths (JSON)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    cfg = config.load(a.config, a.set)
    lengths = [int(x) for x in a.lengths.split(",")]
    points, described = measure_memory(cfg, lengths, a.repeats,
                                       progress=lambda s: print(s, file=sys.stderr, flush=True))
    atomic_write_json(a.out, {"points": points, "described": described})
    return 0


if __name__ == "__main__":
    sys.exit(main())
