"""The serial baseline: materialize every model tensor, convert, then reshard.

This is how the public converters work (load the whole state dict, rename/split in memory,
``save_file`` per shard), kept as the yardstick for ``--verify`` and the benchmark.  It
reads through torch's own DCP loader, so it shares no reading code with the fast path; it
uses the same mapping rules (those are checked separately, against logits).
"""

from __future__ import annotations

from pathlib import Path

from neon_hpc.checkpoint.integrity import guard_reader
from neon_hpc.reshard.execute import one_thread
from neon_hpc.reshard.slabs import apply_op
from neon_hpc.reshard.tasks import DEFAULT_SHARD_CAP, ConversionTasks, out_nbytes


def materialize(work: ConversionTasks, verify_digests: bool = True) -> dict:
    """Every model key as one full tensor, via ``torch.distributed.checkpoint`` (no process group)."""
    # deferred: heavy (torch: the light reshard CLI imports this module)
    import torch
    import torch.distributed.checkpoint as dcp
    keys = sorted({s.key for t in work.tasks for s in t.slabs})
    state = {k: torch.empty(work.ckpt.tensors[k].shape, dtype=getattr(torch, work.ckpt.tensors[k].dtype))
             for k in keys}
    # .metadata was already read by our restricted unpickler in make_tasks, so DCP's own
    # (unrestricted) read of it happens only for a file we have checked.
    reader = dcp.FileSystemReader(str(work.ckpt.path))
    if work.ckpt.digests is not None and verify_digests:      # the same digest check as the fast path, on DCP's reads
        guard_reader(reader, work.ckpt.digests)
    with one_thread():   # same as the fast path: intra-op threads only oversubscribe the cores
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def convert_all(work: ConversionTasks, full: dict) -> dict:
    """HF name -> tensor for the whole model (held in memory at once, as the serial tools do)."""
    out = {}
    for t in work.tasks:
        for s in t.slabs:
            slab = full[s.key][s.index] if s.index else full[s.key]
            for o in s.outputs:
                out[o.name] = apply_op(o.op, slab)
    return out


def reshard_write(hf: dict, dst: Path, shard_cap: int = DEFAULT_SHARD_CAP) -> dict:
    """Split ``hf`` into files of at most ``shard_cap`` bytes (name order); returns the index."""
    from safetensors.torch import save_file  # deferred: heavy (safetensors)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(hf):
        n = hf[name].numel() * hf[name].element_size()
        if groups[-1] and size + n > shard_cap:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: hf[n] for n in names}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    total = sum(hf[n].numel() * hf[n].element_size() for n in hf)
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def expected_bytes(work: ConversionTasks) -> int:
    return sum(out_nbytes(o) for t in work.tasks for s in t.slabs for o in s.outputs)
