"""``neon-hpc engine``: serve the embedded engine, or print SGLang launch lines.

    neon-hpc engine serve --model RUN/weights/v_0 [--host 127.0.0.1] [--port N] [--max-batch-size 16]
                          [--allowed-root DIR (default: RUN/weights)] [--max-new-tokens-cap N]
                          [--request-time-budget-s S]
    neon-hpc engine sglang-cmd CONFIG [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _sglang_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc engine sglang-cmd",
                                description="Print the SGLang server (and PD load balancer) command lines for CONFIG.")
    p.add_argument("config", help="experiment YAML, e.g. configs/kimi_k2_1300xh200.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    a = p.parse_args(argv)
    from neon_hpc import config  # deferred: heavy (neon_hpc.config: h5py, numpy)

    # deferred: heavy (neon_hpc.rollout.engines.sglang_launch: pydantic)
    from neon_hpc.rollout.engines.sglang_launch import endpoint_urls, format_commands, render_commands
    cfg = config.load(a.config, a.set)
    sys.stdout.write(format_commands(render_commands(cfg)))
    print("# rollout workers: NEON_ENGINE_URLS=" + ",".join(endpoint_urls(cfg)))
    return 0


def main(argv: list[str]) -> int:
    usage = "usage: neon-hpc engine {serve,sglang-cmd} ..."
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--model")
        model = pre.parse_known_args(rest)[0].model
        if model and not (Path(model) / "config.json").exists():  # answer before importing torch
            print(f"neon-hpc engine serve: {model}/config.json not found; point --model at an HF weights "
                  f"folder such as RUN/weights/v_0", file=sys.stderr)
            return 2
        # deferred: heavy (neon_hpc.rollout.engines.embedded: torch, numpy)
        from neon_hpc.rollout.engines.embedded import main as serve_main
        return serve_main(rest)
    if cmd == "sglang-cmd":
        return _sglang_cmd(rest)
    print(f"neon-hpc engine: unknown subcommand {cmd!r}\n{usage}", file=sys.stderr)
    return 2
