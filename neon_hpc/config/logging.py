"""The ``logging:`` section: which metrics sinks each role opens (``neon_hpc/util/logsinks.py`` runs them)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from neon_hpc.util.constraints import Rule, section


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


@section
@dataclass
class LoggingConfig:
    tensorboard: bool = False                               # RUN/logs/tb/<role>.<rank>/ event files
    wandb: Literal["off", "offline", "online"] = "off"      # offline: RUN/logs/wandb/, no network
    wandb_project: str = "neon-hpc"
    wandb_entity: str = ""                                  # "" = the account's default

    RULES = (
        Rule("wandb", lambda c: c.wandb != "online" or _wandb_credentials(),
             "online: no W&B credentials found (set WANDB_API_KEY or run `wandb login`), or use "
             "logging.wandb: offline and `wandb sync` later"),
    )
