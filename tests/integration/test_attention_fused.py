"""The trainer's fused attention (``cp_attention.piece_attention``: torch SDPA per run of
contiguous document positions) against references, forward and backward.

Three results per case: the fused path, the einsum reference
(``cp_attention.reference_piece_attention``, the old path: fp32 score matrices per document)
and an independent dense float64 truth written here from the pieces alone (every row of every
rank, same document and position ``<=``, a pad row sees itself).  Cases: packed documents with
pad rows, a document whose local pieces are not adjacent rows, a document with a gap in its
positions (a late run whose keys start before it: the lower-right causal mask), uneven
early/late pieces of one document across 2 CP ranks over gloo (remote K/V rows from the
all-gather, gradients back through it), GQA (8 query heads over 2 KV groups) and MLA-like
head dims (q/k 24, v 16, no grouping), in float32 and bfloat16.

Tolerances, as max |diff| over max |truth| of each tensor (output, grad q, grad k, grad v):

- float32: <= 2e-6 for both the fused path and the reference (measured over all cases and
  both ranks: fused <= 4.0e-7, reference <= 2.9e-7; float32 arithmetic in different orders).
- bfloat16 (inputs, outputs and gradients in bf16; the truth from the same bf16 values in
  float64): <= 2.5e-2, and the fused error at most 2x the reference's + 4e-3 per tensor
  (measured: fused <= 8.6e-3, reference <= 6.2e-3: both round to bf16's 8-bit mantissa, a
  relative step of 3.9e-3; the fused kernel is not materially less exact than the path it
  replaces).

On the CPU every case runs torch's flash kernel, never the math kernel (profiled below):
MLA's v head dim, which the CPU flash kernel refuses, is zero-padded to the q/k head dim.

And memory: one document's attention forward + backward at 4k, 8k and 16k tokens (a fresh
process each, peak RSS over the RSS before the call): at 16k over 8k <= 2.5 (linear: ~2;
the einsum reference is quadratic: ~4), and at 16k under 1/10 of one fp32 score matrix of
the heads (what the reference would hold).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ranks import run_ranks
from repo_paths import with_tests_on_pythonpath

# (query heads, KV groups, q/k head dim, v head dim)
SHAPES = {"gqa": (8, 2, 16, 16), "mla": (4, 4, 24, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 2e-6, "bf16": 2.5e-2}

# one process: doc 0 in two pieces of contiguous positions on non-adjacent rows (one run read by
# gather), doc 1 whole, doc 2 from position 3 (its head is in no slot), doc 3 with a gap in its
# positions (runs [0, 4) and [9, 13): the second attends 4 earlier keys, a lower-right mask);
# 3 pad rows
LOCAL = [[(0, 0, 4), (1, 0, 5), (0, 4, 9), (2, 3, 7), (3, 0, 4), (3, 9, 13)]]
LOCAL_PAD = 3
# two CP ranks: doc 0 (29 tokens) cut unevenly, rank 0 its early [0, 5) and late [20, 29) pieces,
# rank 1 the middle [5, 20) in two pieces around a whole doc; doc 3 a head/tail cut; pads on rank 0
CP = [
    [(0, 0, 5), (1, 0, 6), (3, 0, 3), (0, 20, 29)],
    [(0, 5, 12), (2, 0, 4), (0, 12, 20), (3, 3, 10)],
]
CP_PAD = [2, 0]


def _rows(pieces, n_pad):
    doc = [i for (i, s, e) in pieces for _ in range(s, e)]
    pos = [p for (_i, s, e) in pieces for p in range(s, e)]
    return doc + [-1] * n_pad, pos + [0] * n_pad


def _global(slot, pads, shape, dtype, seed=0):
    """q, k, v, output weights of every row of every rank (rank 0's rows first), the rows' (doc,
    pos) and each rank's row range."""
    h, g, hn, hv = shape
    docs, poss, spans = [], [], []
    for pieces, n_pad in zip(slot, pads):
        d, p = _rows(pieces, n_pad)
        spans.append((len(docs), len(docs) + len(d)))
        docs += d
        poss += p
    n = len(docs)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 1, heads, dim, generator=gen).to(dtype)
               for heads, dim in ((h, hn), (g, hn), (g, hv)))
    w = torch.randn(n, 1, h * hv, generator=gen)
    return (q, k, v, w), docs, poss, spans


def _truth(q, k, v, w, docs, poss):
    """Dense float64 attention over all rows by (doc, position): output and grads of q, k, v."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    n, h, g = q.shape[0], q.shape[2], k.shape[2]
    d = torch.tensor(docs)
    p = torch.tensor(poss)
    allowed = (d[:, None] == d[None, :]) & (p[None, :] <= p[:, None]) & (d[:, None] >= 0)
    allowed |= torch.eye(n, dtype=torch.bool)               # pads: themselves (docs: already)
    qh = q[:, 0].transpose(0, 1)                            # [h, n, hn]
    kh = k[:, 0].transpose(0, 1).repeat_interleave(h // g, 0)
    vh = v[:, 0].transpose(0, 1).repeat_interleave(h // g, 0)
    s = (qh @ kh.transpose(1, 2)) * q.shape[-1] ** -0.5
    o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vh       # [h, n, hv]
    o = o.transpose(0, 1).reshape(n, 1, -1)
    (o * w.double()).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def _run(fn, q, k, v, w, lay):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, lay)
    (o.float() * w).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def _errors(got, want) -> list[float]:
    return [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want)]


def compare(slot, pads, me, shape, dtype, group=None) -> dict:
    """Fused and reference on this rank's rows against the dense truth over all ranks' rows."""
    from neon_hpc.models.cp_attention import build_piece_map, piece_attention, reference_piece_attention
    (q, k, v, w), docs, poss, spans = _global(slot, pads, shape, dtype)
    a, b = spans[me]
    truth = [t[a:b] for t in _truth(q, k, v, w, docs, poss)]
    lay = build_piece_map(slot, me, b - a, group=group)
    mine = [t[a:b] for t in (q, k, v, w)]
    return {"fused": _errors(_run(piece_attention, *mine, lay), truth),
            "reference": _errors(_run(reference_piece_attention, *mine, lay), truth),
            "exchanged": lay.exchanges,
            "runs": [g.runs for g in lay.groups]}


def _check(res: dict, dt: str) -> None:
    for path in ("fused", "reference"):
        assert max(res[path]) <= TOL[dt], (path, res)
    if dt == "bf16":
        for f, r in zip(res["fused"], res["reference"]):
            assert f <= 2 * r + 4e-3, res


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_packed_documents_match_the_references(shape, dt):
    res = compare(LOCAL, [LOCAL_PAD], 0, SHAPES[shape], DTYPES[dt])
    assert not res["exchanged"]
    # doc 0 one run over two pieces, doc 2 from position 3 alone, doc 3 two runs (late: 4 + 4 keys)
    assert res["runs"] == [[(0, 9, 9)], [(0, 5, 5)], [(0, 4, 4)], [(0, 4, 4), (4, 8, 8)]]
    _check(res, dt)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_cpu_runs_the_flash_kernel_not_the_math_kernel(shape):
    """Every run of LOCAL (causal and lower-right) forward and backward, GQA and MLA dims: the
    math kernel (an [heads, Lq, Lk] score matrix) would make memory quadratic again."""
    from neon_hpc.models.cp_attention import build_piece_map, piece_attention
    (q, k, v, w), *_ = _global(LOCAL, [LOCAL_PAD], SHAPES[shape], torch.float32)
    lay = build_piece_map(LOCAL, 0, q.shape[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(piece_attention, q, k, v, w, lay)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names, names
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_expanded_kv_path_matches_too(monkeypatch):
    """Where the kernel takes no GQA (CUDA's memory-efficient attention, e.g. float32 on a
    GPU), K/V are expanded to the query heads: the same numbers, run here on the CPU.  And the
    CUDA flash query is callable in this torch (False for CPU tensors)."""
    from neon_hpc.models import cp_attention as C
    (q, k, v, _w), *_ = _global(LOCAL, [LOCAL_PAD], SHAPES["gqa"], torch.float32)
    assert C._flash_takes(q[:, 0], k[:, 0], v[:, 0]) is False
    orig = C._Sdpa.__init__

    def expanding(self, *a, **kw):
        orig(self, *a, **kw)
        assert self.gqa
        self.native_gqa = False
    monkeypatch.setattr(C._Sdpa, "__init__", expanding)
    res = compare(LOCAL, [LOCAL_PAD], 0, SHAPES["gqa"], torch.float32)
    _check(res, "fp32")


def test_piece_map_runs_and_key_order_of_cp_pieces():
    from neon_hpc.models.cp_attention import build_piece_map
    l0 = build_piece_map(CP, 0, 5 + 6 + 3 + 9 + CP_PAD[0])
    g0 = l0.groups[0]
    assert g0.q_pos.tolist() == list(range(5)) + list(range(20, 29))
    assert g0.key_pos.tolist() == list(range(29))           # local and remote keys, by position
    assert g0.runs == [(0, 5, 5), (5, 14, 29)]              # early: causal; late: 9 queries over 29 keys
    assert l0.groups[2].runs == [(0, 3, 3)]                 # doc 3's head: no earlier key anywhere
    l1 = build_piece_map(CP, 1, 7 + 4 + 8 + 7)
    assert l1.groups[0].runs == [(0, 15, 20)] and l1.groups[2].runs == [(0, 7, 10)]
    assert l1.inverse is not None and l0.pad_idx.tolist() == [23, 24]
    with pytest.raises(ValueError, match="document 0 holds a position twice"):
        build_piece_map([[(0, 0, 4)], [(0, 2, 6)]], 0, 4)


# --------------------------------------------------------------------------------------
# two CP ranks over gloo

def _cp_worker(out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    me = dist.get_rank()
    res = {f"{s}-{d}": compare(CP, CP_PAD, me, SHAPES[s], DTYPES[d], group=dist.group.WORLD)
           for s in SHAPES for d in DTYPES}
    Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    run_ranks(2, lambda r: [__file__, "cp", str(tmp / f"r{r}.json")])
    return [json.loads((tmp / f"r{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_uneven_early_late_pieces_on_two_ranks_match_the_references(cp_results, shape, dt):
    for r, res in enumerate(cp_results):
        x = res[f"{shape}-{dt}"]
        assert x["exchanged"], (r, x)
        _check(x, dt)
    assert cp_results[0][f"{shape}-{dt}"]["runs"][0] == [[0, 5, 5], [5, 14, 29]]


# --------------------------------------------------------------------------------------
# memory linear in length

def _mem_worker(n: str, out: str) -> None:
    """One document of ``n`` tokens, forward + backward of the fused attention (GQA 8/2, dim 32,
    fp32); writes the peak RSS above the RSS before the call (``train.heap.PeakMemory``: the
    high-water mark reset at the start, large allocations mapped on their own)."""
    from neon_hpc.models.cp_attention import build_piece_map, piece_attention
    from neon_hpc.train.heap import PeakMemory
    torch.set_num_threads(1)
    n = int(n)
    h, g, d = 8, 2, 32
    mem = PeakMemory(cuda=False, mmap_large=True)
    q, k, v = (torch.randn(n, 1, heads, d, requires_grad=True) for heads in (h, g, g))
    w = torch.randn(n, 1, h * d)
    small = build_piece_map([[(0, 0, 64)]], 0, 64)     # warm-up: the kernels' thread buffers
    piece_attention(q[:64], k[:64], v[:64], small).sum().backward()
    q.grad = k.grad = v.grad = None
    lay = build_piece_map([[(0, 0, n)]], 0, n)
    with mem:
        (piece_attention(q, k, v, lay) * w).sum().backward()
    Path(out).write_text(json.dumps({"n": n, "bytes": mem.peak - mem.base, "scores_bytes": h * n * n * 4}))


@pytest.mark.slow      # three fresh processes, 16k tokens on one thread: ~20 s idle, 3.5 min on the shared 2 cores
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="resets the peak RSS through /proc/self/clear_refs (Linux)")
def test_attention_memory_grows_linearly_with_length(tmp_path):
    got = {}
    for n in (4096, 8192, 16384):
        out = tmp_path / f"{n}.json"
        subprocess.run([sys.executable, __file__, "mem", str(n), str(out)], check=True, timeout=300,
                       env=with_tests_on_pythonpath(dict(os.environ, OMP_NUM_THREADS="1")))
        got[n] = json.loads(out.read_text())
    print({n: round(x["bytes"] / 2**20, 1) for n, x in got.items()}, "MiB")
    assert got[16384]["bytes"] <= 2.5 * got[8192]["bytes"], got
    assert got[16384]["bytes"] < got[16384]["scores_bytes"] / 10, got


if __name__ == "__main__":
    {"cp": _cp_worker, "mem": _mem_worker}[sys.argv[1]](*sys.argv[2:])
