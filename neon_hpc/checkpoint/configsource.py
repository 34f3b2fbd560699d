"""The model config a checkpoint carries: its own ``config.json``, or its run's ``run.yaml``.

The trainer writes the model's HF ``config.json`` (:func:`hf_config_for_model` of the ``model:``
section) into every checkpoint it saves; a checkpoint inside a run directory
(``RUN/checkpoints/step_N``) also has the run's ``run.yaml`` two levels up (:func:`run_yaml`),
whose ``model`` section gives the same config.  :func:`read_config_json` reads such a file at
its edge (one error naming the file and field).  The order in which a converter tries these,
after what its caller passes and before deriving one from shapes, is reshard's
(``neon_hpc/reshard/hfconfig.py``).
"""

from __future__ import annotations

from pathlib import Path

from neon_hpc.arch import ARCHITECTURES, get as get_architecture
from neon_hpc.checkpoint.metadata import CheckpointError, read_json_object
from neon_hpc.util.bounded import short_repr

CONFIG_FILE = "config.json"
from neon_hpc.protocol.rundir import RUN_YAML as RUN_CONFIG  # noqa: E402  (the run's config file)

# the config.json fields a checkpoint's shapes decide, per architecture: its ``shape_fields``
SHAPE_FIELDS = {name: list(a.shape_fields) for name, a in ARCHITECTURES.items()}


def run_yaml(ckpt_path: Path) -> Path:
    """Where the run's config is when ``ckpt_path`` is ``RUN/checkpoints/step_N``."""
    return Path(ckpt_path).absolute().parent.parent / RUN_CONFIG


def hf_config_for_model(model_cfg) -> dict:
    """The HF ``config.json`` (a dict) that a ``model:`` section (a ModelConfig) implies.

    The trainer writes this into each checkpoint, and reshard derives it from a run's
    ``run.yaml``: one function (the architecture's ``hf_config_dict``, its folder's ``hfmap.py``),
    so both agree."""
    return dict(get_architecture(model_cfg.arch).hf_config_dict(model_cfg))


def read_config_json(path: Path, error: type[CheckpointError] = CheckpointError) -> dict:
    """``path`` (an HF ``config.json``) parsed and its fields' types checked; ``error`` otherwise."""
    cfg = read_json_object(path, "an HF config.json", error)
    if cfg is None:
        raise error(f"{path} is missing")
    check_field_types(cfg, str(path), error)
    return cfg


def check_field_types(cfg: dict, where: str, error: type[CheckpointError] = CheckpointError) -> None:
    """The fields reshard computes with are integers (``vocab_size``, the shape fields) or a
    string (``model_type``): anything else is refused naming the field, not met later as a
    TypeError deep in the task builder."""
    ints = {"vocab_size", *(k for ks in SHAPE_FIELDS.values() for k in ks)}
    for k in sorted(ints & set(cfg)):
        v = cfg[k]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise error(f"{where}: {k} is {short_repr(v)}, not a non-negative integer; the config is "
                       f"damaged or not this model's HF config.json")
    for k in ("model_type",):
        if k in cfg and cfg[k] is not None and not isinstance(cfg[k], str):
            raise error(f"{where}: {k} is {short_repr(cfg[k])}, not a string")
    if "architectures" in cfg and not (isinstance(cfg["architectures"], list)
                                       and all(isinstance(a, str) for a in cfg["architectures"])):
        raise error(f"{where}: architectures is {short_repr(cfg['architectures'])}, not a list of strings")
