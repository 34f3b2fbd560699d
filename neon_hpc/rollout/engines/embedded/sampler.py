"""A request's sampler: its sampling parameters, normalised once at admission.

``wire.parse_sampling`` refuses what breaks the wire format (types, ranges, NaN); what
passes is turned here, once per request, into a :class:`Sampler` whose ``choose`` cannot fail
on finite logits with at least one finite entry, whatever the parameters:

- greedy when ``temperature`` is below :data:`GREEDY_TEMPERATURE` or ``top_k == 1``;
  otherwise the temperature is a finite positive float;
- ``top_k`` is ``None`` (off) or in ``[2, vocab]``;
- ``top_p`` is ``None`` (off, 1.0) or in ``(0, 1)``, and the nucleus always keeps the most
  likely token: ``top_p * total`` may underflow to 0 in float32 (``top_p=1e-300``), which
  used to keep nothing and fail the whole running batch.

What the sampler cannot rule out (logits that are all ``-inf`` or NaN: a model bug) raises
inside ``choose``; the scheduler then evicts that row alone with its own error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neon_hpc.rollout.engines import wire

GREEDY_TEMPERATURE = 1e-6   # SGLang's threshold: below it sampling is argmax


@dataclass(frozen=True)
class Sampler:
    greedy: bool
    temperature: float          # 1.0 when greedy (logprobs are then of the untempered logits)
    top_k: int | None           # None: off
    top_p: float | None         # None: off

    @classmethod
    def from_params(cls, s: wire.Sampling, vocab_size: int) -> "Sampler":
        """Normalise parameters that :func:`wire.parse_sampling` accepted."""
        greedy = s.temperature < GREEDY_TEMPERATURE or s.top_k == 1
        if greedy:
            return cls(True, 1.0, None, None)
        top_k = None if s.top_k < 1 or s.top_k >= vocab_size else int(s.top_k)
        top_p = None if s.top_p >= 1.0 else float(s.top_p)
        return cls(False, float(s.temperature), top_k, top_p)

    def choose(self, logits: torch.Tensor, gen: torch.Generator | None,
               original_logprob: bool) -> tuple[int, float]:
        """One token from ``[V]`` logits; returns (token, logprob as SGLang reports it)."""
        logprobs = torch.log_softmax(logits / self.temperature, dim=-1)  # SGLang: after temperature
        if self.greedy:
            tok = int(torch.argmax(logits))
        else:
            probs = logprobs.exp()
            if self.top_k is not None:
                kth = torch.topk(probs, self.top_k).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            if self.top_p is not None:
                sorted_p, order = torch.sort(probs, descending=True)
                keep = (sorted_p.cumsum(0) - sorted_p) < self.top_p * sorted_p.sum()
                keep[0] = True   # the most likely token, even where top_p * total underflows to 0
                mask = torch.zeros_like(probs, dtype=torch.bool)
                mask[order[keep]] = True
                probs = torch.where(mask, probs, torch.zeros_like(probs))
            tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        lp = torch.log_softmax(logits, dim=-1)[tok] if original_logprob else logprobs[tok]
        return tok, float(lp)
