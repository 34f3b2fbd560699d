"""The off-policy corrections of the policy loss: one function and one name each, in a small registry.

A correction turns the per-token importance ratio of the proximal policy over the behaviour policy
(``ratio = exp(logp_prox - behaviour_logprobs)``, detached, generated tokens only) into the weight the
policy-gradient term of that token is multiplied by (``neon_hpc/train/loss.py``), and reports the
per-token metrics it declares::

    @correction("tis", metrics=("tis_weight_mean", "tis_clip_frac"))
    def tis(ratio, cap: float = 2.0):
        w = ratio.clamp(max=cap)
        return w, {"tis_weight_mean": w, "tis_clip_frac": (ratio > cap).to(ratio.dtype)}

- its parameters are the function's keyword arguments, with their defaults; ``offpolicy.correction_params``
  overrides them (``{cap: 3.0}``);
- each metric is a per-token value; the step logs its mean over the step's generated tokens under that
  name (``metrics.jsonl``).

``offpolicy.correction`` names a registered one (``tis``, ``none``) or a user's function by import path
(``pkg.mod:fn``, decorated with ``@correction`` in its own module, as ``tests/correction_fixture.py``):
:func:`resolve` imports it, :func:`check` (the trainer's start-up check, so ``neon-hpc config check``)
refuses one that cannot be imported, is not registered, takes a parameter it does not declare, or returns
the wrong shape.  Torch is not imported here: a correction works on the tensors it is given.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable


class CorrectionError(ValueError):
    """``offpolicy.correction`` / ``correction_params`` name something that cannot be used; says how to fix it."""


@dataclass(frozen=True)
class Correction:
    name: str
    fn: Callable[..., Any]
    metrics: tuple[str, ...]
    params: dict[str, float]            # the declared parameters and their defaults


@dataclass(frozen=True)
class Bound:
    """A correction with its parameters (the registered defaults, overridden by the config's)."""

    correction: Correction
    params: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.correction.name

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.correction.metrics

    def __call__(self, ratio):
        """``(weight, {metric: per-token tensor})`` for the per-token ``ratio``."""
        w, terms = self.correction.fn(ratio, **self.params)
        if set(terms) != set(self.metrics):
            raise CorrectionError(f"offpolicy.correction {self.name!r}: returned metrics {sorted(terms)}, "
                                  f"declared {list(self.metrics)}; return exactly the declared ones")
        return w, terms


REGISTRY: dict[str, Correction] = {}


def correction(name: str, metrics: tuple[str, ...] = ()) -> Callable:
    """Register ``fn(ratio, **params) -> (weight, {metric: tensor})`` under ``name`` (module docstring)."""
    def register(fn: Callable) -> Callable:
        c = Correction(name, fn, tuple(metrics), _declared_params(name, fn))
        if name in REGISTRY and REGISTRY[name].fn is not fn:
            raise CorrectionError(f"correction {name!r} is registered twice ({_where(REGISTRY[name].fn)} and "
                                  f"{_where(fn)}); give one of them another name")
        REGISTRY[name] = c
        fn.correction = c
        return fn
    return register


def _where(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def _declared_params(name: str, fn: Callable) -> dict[str, float]:
    sig = inspect.signature(fn)
    ps = list(sig.parameters.values())
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD) or \
            ps[0].default is not ps[0].empty:
        raise CorrectionError(f"correction {name!r} ({_where(fn)}): its first parameter must be the per-token "
                              f"ratio, without a default: def {fn.__name__}(ratio, ...)")
    out = {}
    for p in ps[1:]:
        if p.default is p.empty or isinstance(p.default, bool) or not isinstance(p.default, (int, float)):
            raise CorrectionError(f"correction {name!r} ({_where(fn)}): parameter {p.name!r} needs a numeric "
                                  f"default (its value when offpolicy.correction_params does not set it)")
        out[p.name] = float(p.default)
    return out


def resolve(name: str) -> Correction:
    """The correction ``offpolicy.correction`` names: registered, or imported from ``pkg.mod:fn``."""
    if ":" not in name:
        if name not in REGISTRY:
            raise CorrectionError(f"offpolicy.correction: {name!r} is not a registered correction (registered: "
                                  f"{', '.join(sorted(REGISTRY))}); or give a function's import path 'pkg.mod:fn'")
        return REGISTRY[name]
    mod_name, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:   # noqa: BLE001 - any import failure is the config's problem, said in one line
        raise CorrectionError(f"offpolicy.correction: cannot import module {mod_name!r} of {name!r} "
                              f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise CorrectionError(f"offpolicy.correction: module {mod_name!r} has no {attr!r} ({name!r})")
    c = getattr(fn, "correction", None)
    if not isinstance(c, Correction):
        raise CorrectionError(f"offpolicy.correction: {name!r} is not registered: decorate it with "
                              f"@neon_hpc.train.corrections.correction(\"<name>\", metrics=(...))")
    return c


def bind(name: str, params: dict[str, float] | None = None) -> Bound:
    """``name`` resolved, with the registered defaults overridden by ``params``."""
    c = resolve(name)
    params = dict(params or {})
    unknown = sorted(set(params) - set(c.params))
    if unknown:
        raise CorrectionError(f"offpolicy.correction_params.{unknown[0]}: not a parameter of correction {c.name!r} "
                              f"(its parameters: {', '.join(c.params) or 'none'}); remove it")
    return Bound(c, {**c.params, **{k: float(v) for k, v in params.items()}})


def of(offpolicy: Any) -> Bound:
    """The correction the ``offpolicy`` section asks for."""
    return bind(offpolicy.correction, offpolicy.correction_params)


def check(offpolicy: Any) -> None:
    """Resolve and try the configured correction on a small ratio (the trainer's start-up check)."""
    import torch  # deferred: heavy (torch); the registry itself does not need it

    b = of(offpolicy)
    ratio = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    try:
        w, terms = b(ratio)
    except CorrectionError:
        raise
    except Exception as e:   # noqa: BLE001 - a user's function failing is reported with its name
        raise CorrectionError(f"offpolicy.correction {b.name!r}: failed on a test ratio "
                              f"({type(e).__name__}: {e})") from None
    for what, t in (("weight", w), *terms.items()):
        if not isinstance(t, torch.Tensor) or t.shape != ratio.shape:
            raise CorrectionError(f"offpolicy.correction {b.name!r}: {what} must be a tensor shaped like the "
                                  f"ratio, got {type(t).__name__} {tuple(getattr(t, 'shape', ()))}")


# --------------------------------------------------------------------------------------
# the built-in corrections

@correction("tis", metrics=("tis_weight_mean", "tis_clip_frac"))
def tis(ratio, cap: float = 2.0):
    """Truncated importance sampling: ``min(ratio, cap)`` per token (``tis_clip_frac``: tokens truncated)."""
    if not (math.isfinite(cap) and cap >= 1.0):
        raise CorrectionError(f"offpolicy.correction_params.cap: got {cap}; allowed: a finite number >= 1 "
                              f"(it truncates importance ratios from above)")
    w = ratio.clamp(max=cap)
    return w, {"tis_weight_mean": w, "tis_clip_frac": (ratio > cap).to(ratio.dtype)}


@correction("none", metrics=("tis_weight_mean", "tis_clip_frac"))
def none(ratio):
    """No correction: weight 1 (assumes on-policy data; an async run refuses it, config/cross.py)."""
    one = ratio.new_ones(ratio.shape)
    return one, {"tis_weight_mean": one, "tis_clip_frac": ratio.new_zeros(ratio.shape)}
