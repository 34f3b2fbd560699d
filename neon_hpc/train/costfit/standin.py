"""Real compute for calibration and for the benchmark's measured step time.

A plain-torch transformer of a ``ModelConfig``'s shape: per layer a fused Q/K/V projection
(GQA), causal attention through ``torch.nn.functional.scaled_dot_product_attention`` run
per document (packed documents never attend to each other), the output projection, and a
SwiGLU MLP as wide as the tokens' active experts (``top_k * moe_ffn_hidden_size``; the
MoE's routing is not what the cost model is about); an LM head and cross-entropy at the
end.  Forward + backward, parameters get gradients.

A piece ``[start, end)`` that does not begin at token 0 (a chunk of a split sequence)
attends to K/V of its prefix ``[0, start)`` as well, which in a real run arrive from the
ranks holding those chunks: here they are leaf tensors that require grad, so their
score, value and gradient compute is paid, the transfer is not.

torch is imported lazily: balancing never needs it.
"""

from __future__ import annotations

import time
from typing import Sequence


def build_model(model_cfg, seed: int = 0):
    # deferred: heavy (torch)
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h, H, G, d, ffn):
            super().__init__()
            self.H, self.G, self.d = H, G, d
            self.norm1 = nn.RMSNorm(h)
            self.qkv = nn.Linear(h, (H + 2 * G) * d, bias=False)
            self.o = nn.Linear(H * d, h, bias=False)
            self.norm2 = nn.RMSNorm(h)
            self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
            self.down = nn.Linear(ffn, h, bias=False)

        def forward(self, x, pieces):
            H, G, d = self.H, self.G, self.d
            qkv = self.qkv(self.norm1(x))
            q, k, v = qkv.split([H * d, G * d, G * d], dim=-1)
            outs, off = [], 0
            for start, end in pieces:
                n = end - start
                outs.append(attend(q[off:off + n], k[off:off + n], v[off:off + n], start, H, G, d))
                off += n
            x = x + self.o(torch.cat(outs, dim=0))
            g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(nn.functional.silu(g) * u)

    class Model(nn.Module):
        def __init__(self, c):
            super().__init__()
            ffn = c.moe_ffn_hidden_size * c.moe_router_topk
            self.blocks = nn.ModuleList(Block(c.hidden_size, c.num_attention_heads,
                                              c.num_query_groups, c.head_dim, ffn)
                                        for _ in range(c.num_layers))
            self.norm = nn.RMSNorm(c.hidden_size)
            self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

        def forward(self, x, pieces):
            for blk in self.blocks:
                x = blk(x, pieces)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    return Model(model_cfg)


def attend(q, k, v, start, H, G, d, prefix=None):
    """Causal attention of queries at positions ``[start, start+n)`` over keys ``[0, start+n)``.
    ``q``: (n, H*d); ``k``, ``v``: (n, G*d) for the piece's own tokens; ``prefix``: optional
    (K, V) of positions ``[0, start)`` shaped (1, H, start, d), random when not given."""
    # deferred: heavy (torch)
    import torch
    import torch.nn.functional as F
    n = q.shape[0]
    q = q.view(n, H, d).transpose(0, 1).unsqueeze(0)
    k = k.view(n, G, d).transpose(0, 1).unsqueeze(0)
    v = v.view(n, G, d).transpose(0, 1).unsqueeze(0)
    if H != G:   # GQA: share each K/V head across its query group (same kernel for every piece)
        k = k.repeat_interleave(H // G, dim=1)
        v = v.repeat_interleave(H // G, dim=1)
    if start == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        # K/V of the prefix are held by other ranks (their gradients flow back there).  As ring
        # attention does: scores against the prefix (no mask) and against the own chunk
        # (causal) in two flash calls, merged by their log-sum-exps.  (An explicit
        # lower-right causal mask would take the slow math kernel on CPU.)
        if prefix is None:
            prefix = (torch.randn(1, H, start, d, requires_grad=True),
                      torch.randn(1, H, start, d, requires_grad=True))
        kp, vp = prefix
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, kp, vp, 0.0, False)
        o2, l2 = flash(q, k, v, 0.0, True)
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m).unsqueeze(-1), torch.exp(l2 - m).unsqueeze(-1)
        o = (o1 * w1 + o2 * w2) / (w1 + w2)
    return o.squeeze(0).transpose(0, 1).reshape(n, H * d)


class Runner:
    """Times forward + backward of micro-batches on one model instance.

    ``clock="cpu"`` (default) reads the process's CPU time: on a machine shared with other
    jobs, wall time mostly measures the neighbours, while CPU time of a single-threaded
    run stays close to what the run would take alone.  ``clock="wall"`` for a quiet
    machine or several threads.
    """

    def __init__(self, model_cfg, threads: int = 1, seed: int = 0, clock: str = "cpu"):
        import torch  # deferred: heavy (torch)
        if clock not in ("cpu", "wall"):
            raise ValueError(f"Runner: clock must be 'cpu' or 'wall', got {clock!r}")
        torch.set_num_threads(threads)
        self.now = time.process_time if clock == "cpu" else time.perf_counter
        self.torch = torch
        self.cfg = model_cfg
        self.model = build_model(model_cfg, seed)
        self.gen = torch.Generator().manual_seed(seed)

    def run(self, pieces: Sequence[tuple[int, int]]) -> float:
        """Seconds for one forward + backward over ``pieces`` = [(start, end), ...]."""
        torch = self.torch
        if not pieces:
            return 0.0
        total = sum(e - s for s, e in pieces)
        x = torch.randn(total, self.cfg.hidden_size, generator=self.gen)
        labels = torch.randint(0, self.cfg.vocab_size, (total,), generator=self.gen)
        t0 = self.now()
        logits = self.model(x, list(pieces))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        dt = self.now() - t0
        self.model.zero_grad(set_to_none=True)
        return dt

    def best_of(self, pieces, repeats: int = 3) -> float:
        return min(self.run(pieces) for _ in range(max(1, repeats)))
