"""Stand-in for ``python -m sglang.launch_server`` (see ../README.md): strict flags,
multi-node rendezvous, and the embedded engine behind SGLang's /generate subset."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (neon-hpc test stand-in)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--enable-dp-lm-head", action="store_true")
    p.add_argument("--moe-a2a-backend", choices=["none", "deepep", "mooncake"], default="none")
    p.add_argument("--deepep-mode", choices=["normal", "low_latency", "auto"], default="auto")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-transfer-backend", choices=["mooncake", "nixl", "ascend", "fake"],
                   default="mooncake")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    a = p.parse_args(argv)
    if a.tp_size % a.dp_size:
        p.error(f"--tp-size {a.tp_size} must be a multiple of --dp-size {a.dp_size}")
    if a.dp_size > 1 and not a.enable_dp_attention:
        p.error("--dp-size > 1 without --enable-dp-attention")
    if a.nnodes > 1 and not a.dist_init_addr:
        p.error("--nnodes > 1 needs --dist-init-addr")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} outside 0..{a.nnodes - 1}")
    if a.nnodes > 1 and "${" in a.dist_init_addr:
        p.error(f"--dist-init-addr {a.dist_init_addr!r} holds an unexpanded variable")
    return a


_PEERS: list[socket.socket] = []


def rendezvous(a: argparse.Namespace) -> socket.socket | None:
    """Rank 0 accepts nnodes-1 peers, each announcing a distinct rank; peers hold the line."""
    host, port = a.dist_init_addr.rsplit(":", 1)
    if a.node_rank == 0:
        srv = socket.create_server((host, int(port)), reuse_port=False)
        srv.settimeout(300)
        seen, peers = set(), []
        while len(seen) < a.nnodes - 1:
            conn, _ = srv.accept()
            rank = int(conn.recv(16).decode().strip() or -1)
            if rank in seen or not 0 < rank < a.nnodes:
                print(f"rendezvous: bad or duplicate node rank {rank}", flush=True)
                sys.exit(3)
            seen.add(rank)
            peers.append(conn)
            print(f"rendezvous: node rank {rank} joined ({len(seen) + 1}/{a.nnodes})", flush=True)
        _PEERS.extend(peers)  # kept open for the server's lifetime: peers exit when it goes
        return srv
    deadline = time.monotonic() + 300
    while True:
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"rendezvous: no rank 0 at {a.dist_init_addr}", flush=True)
                sys.exit(3)
            time.sleep(0.5)
    s.settimeout(None)
    s.sendall(f"{a.node_rank}\n".encode())
    print(f"rendezvous: joined {a.dist_init_addr} as node rank {a.node_rank}", flush=True)
    return s


def serve(a: argparse.Namespace) -> int:
    from neon_hpc.rollout.engines import embedded
    from neon_hpc.rollout.engines.embedded.server import _Handler

    mode = a.disaggregation_mode
    original = _Handler._generate

    def generate(self, body):
        if isinstance(body, dict) and mode != "null":
            missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if k not in body]
            if missing:
                return self._error(400, f"{mode} server needs {', '.join(missing)} (send requests through the "
                                        f"PD load balancer)")
            body = {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
            if mode == "prefill":   # a prefill server computes the prompt; decode generates
                sp = body.get("sampling_params")
                one = lambda d: dict(d or {}, max_new_tokens=1)  # noqa: E731
                body["sampling_params"] = [one(d) for d in sp] if isinstance(sp, list) else one(sp)
            self.server.scheduler.stats["bootstrapped"] = self.server.scheduler.stats.get("bootstrapped", 0) + 1
        if isinstance(body, dict) and body.get("return_routed_experts") and not a.enable_return_routed_experts:
            return self._error(400, "return_routed_experts needs --enable-return-routed-experts")
        return original(self, body)

    _Handler._generate = generate
    srv = embedded.serve(a.model_path, a.host, a.port, a.max_running_requests or 16, a.weight_version)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown, daemon=True).start())
    print(json.dumps({"stand_in": "sglang.launch_server", "mode": mode, "url": srv.url,
                      "weight_version": srv.scheduler.version, "tp_size": a.tp_size, "nnodes": a.nnodes}), flush=True)
    print("The server is fired up and ready to roll!", flush=True)
    try:
        srv.serve_forever()
    finally:
        print(f"stand-in: served {srv.scheduler.stats.get('bootstrapped', 0)} bootstrapped requests, "
              f"weight version {srv.scheduler.version}", flush=True)
        srv.scheduler.close()
        srv.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    print(f"stand-in sglang.launch_server pid {os.getpid()} node rank {a.node_rank}/{a.nnodes} "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}", flush=True)
    link = rendezvous(a) if a.nnodes > 1 else None
    if a.node_rank > 0:
        # like a scheduler-only SGLang node: no HTTP; ends when rank 0 goes away or on SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        link.recv(1)
        print("rendezvous: rank 0 closed the link; exiting", flush=True)
        return 1
    return serve(a)


if __name__ == "__main__":
    sys.exit(main())
