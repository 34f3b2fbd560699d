"""engine.kind: sglang — the rollout node places, starts, health-checks and stops SGLang servers.

SGLang's server needs a GPU, so the process-level tests put ``tests/standins`` first on
PYTHONPATH: the golden-tested command lines run unchanged, and ``python -m
sglang.launch_server`` is a stand-in with SGLang's flags (strict), its multi-node rendezvous and
the PD bootstrap check (see tests/standins/README.md). The PD router is the real sglang_router.
Everything else is real: the launcher, the node, workers, the trainer, Slurm.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from neon_hpc import config
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.rollout.engines.fleet import Fleet, FleetError, node_addresses, resolve
from neon_hpc.rollout.engines.sglang_launch import layout, render_commands
from neon_hpc.util.logs import RoleLogger, read_metrics
from neon_hpc.util.netutil import free_port
from repo_paths import REPO

NEON = [sys.executable, "-m", "neon_hpc.cli"]
KIMI = REPO / "configs" / "kimi_k2_1300xh200.yaml"
TINY = REPO / "configs" / "tiny_cpu.yaml"
STANDINS = str(REPO / "tests" / "standins")


def _fleet(tmp_path, cfg, node=0, count=None, addrs=None):
    run = RunDir(tmp_path / "run")
    log = RoleLogger.open(run.root, "rollout-node", node, echo=False)
    count = count or layout(cfg).nodes_needed
    return Fleet(cfg, run, node, count, log, addrs=addrs or [f"10.0.0.{i}" for i in range(count)])


# --- placement and addresses (no processes) ------------------------------------------

def test_kimi_layout_spans_eight_nodes_per_engine():
    lay = layout(config.load(KIMI))
    assert (lay.nodes_per_engine, lay.engines_per_node, lay.nodes_needed) == (8, 1, 128)
    assert lay.head_nodes() == list(range(0, 128, 8))
    assert lay.processes_on(9) == [(1, 1, None)]       # engine 1, its node rank 1
    assert lay.processes_on(128) == []                 # spare nodes of the 131 run nothing


def test_small_engines_share_a_node_on_disjoint_gpus():
    cfg = config.load(TINY, ["engine.kind=sglang", "engine.num_engines=5", "engine.tp_size=2",
                             "launch.rollout.nodes=2"])
    lay = layout(cfg)
    assert (lay.engines_per_node, lay.nodes_needed) == (4, 2)
    assert lay.processes_on(0) == [(0, 0, "0,1"), (1, 0, "2,3"), (2, 0, "4,5"), (3, 0, "6,7")]
    assert lay.processes_on(1) == [(4, 0, "0,1")]


def test_pd_fleet_addresses_and_worker_urls(tmp_path):
    cfg = config.load(KIMI)
    f = _fleet(tmp_path, cfg, node=8)
    assert f.vars["NEON_ENGINE1_HOST"] == "10.0.0.8"            # multi-node: the rendezvous address
    assert f.load_balancer_url() == "http://10.0.0.0:8000"
    assert f.worker_url(5) == f.load_balancer_url()                    # PD: every worker goes through the load balancer
    assert f.local_heads() == [1] and f.head_urls() == ["http://10.0.0.8:30001"]
    argv = f._argv(render_commands(cfg)[1], 1, 7, Path("/runs/k/weights/v_7"))
    assert argv[0] == sys.executable and argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--dist-init-addr") + 1] == "10.0.0.8:20001"
    # a resumed run's engines start on the newest weights, not v_0
    assert argv[argv.index("--model-path") + 1] == "/runs/k/weights/v_7"
    assert argv[argv.index("--weight-version") + 1] == "7"


def test_colocated_workers_talk_to_their_own_node_and_loopback_stays_local(tmp_path):
    cfg = config.load(TINY, ["engine.kind=sglang", "engine.num_engines=2", "engine.python=/opt/sgl/bin/python"])
    f = _fleet(tmp_path, cfg, addrs=["10.1.1.1"])
    assert f.worker_nodes() == [0]
    assert [f.worker_url(w) for w in range(3)] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001",
                                                   "http://127.0.0.1:30000"]
    argv = f._argv(["python", "-m", "sglang.launch_server", "--model-path", "x"], 0, 0, Path("/w/v_0"))
    assert argv[0] == "/opt/sgl/bin/python"


def test_unknown_variable_in_a_launch_line_is_an_error():
    with pytest.raises(FleetError, match=r"\$\{NEON_NOPE\}"):
        resolve(["--x", "${NEON_NOPE}:1"], {"NEON_NODE_RANK": "0"})


def test_too_few_nodes_says_what_to_raise(tmp_path):
    cfg = config.load(KIMI)
    with pytest.raises(FleetError, match=r"need 128 rollout node\(s\).*but 10 run: raise launch.rollout.nodes"):
        _fleet(tmp_path, cfg, count=10)


def test_config_refuses_layouts_that_cannot_work():
    with pytest.raises(config.ConfigError, match=r"launch.rollout.nodes: 16 engine\(s\) of 64 GPUs"):
        config.load(KIMI, ["launch.rollout.nodes=127"])
    with pytest.raises(config.ConfigError, match="engine.host: 127.0.0.1 is reachable from its own node only"):
        config.load(KIMI, ["engine.host=127.0.0.1"])


def test_node_addresses_from_env_and_defaults(monkeypatch):
    for k in ("NEON_NODE_ADDRS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    assert node_addresses(1) == ["127.0.0.1"]
    with pytest.raises(FleetError, match="set NEON_NODE_ADDRS"):
        node_addresses(2)
    monkeypatch.setenv("NEON_NODE_ADDRS", "a,b")
    assert node_addresses(2) == ["a", "b"]
    with pytest.raises(FleetError, match="lists 2 address"):
        node_addresses(3)


@pytest.mark.slurm
def test_node_addresses_under_slurm_use_node_addr(slurm_cluster, monkeypatch):
    monkeypatch.delenv("NEON_NODE_ADDRS", raising=False)
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1-2]")
    addrs = node_addresses(2)
    # the emulated nodes n1, n2 do not resolve; their NodeAddr does
    want = [re.search(r"NodeAddr=(\S+)", slurm_cluster.run("scontrol", "show", "node", n, "-o").stdout).group(1)
            for n in ("n1", "n2")]
    assert addrs == want
    with pytest.raises(FleetError, match="one rollout-node task per node"):
        node_addresses(3)


# --- real processes: the node starts the stand-ins -------------------------------------

def _run(root: Path, sets: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STANDINS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = NEON + ["run", str(TINY), "--run-dir", str(root), "--no-plot", "--set", "engine.kind=sglang",
                  "--set", "warm_start.enabled=false", "--set", "eval.num_tasks=0"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _served_version(log: str) -> int:
    """The weight version a stand-in engine held when it stopped (its last log line says it)."""
    return int(re.findall(r"weight version (\d+)", log)[-1])


# The runs below bound offpolicy.max_staleness to train.steps - 2, so the last step keeps no token of
# version 0: an engine must have loaded published weights, whatever the trainer's speed. (Which
# version it holds when the run ends is timing: the trainer may finish before the engine loads the
# newest one, more so with checkpoints written beside the steps.)


def _left(root: Path) -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.NoSuchProcess:
            continue
        if str(root) in cmd and p.pid != os.getpid():
            out.append(cmd)
    return out


@pytest.mark.slow
def test_node_starts_sglang_and_trains_on_it(tmp_path):
    root = tmp_path / "run"
    r = _run(root, ["train.steps=3", "offpolicy.max_staleness=1", f"engine.port={free_port()}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (root / "logs" / "engine" / "0.log").read_text()
    first = log.splitlines()[0]
    # the exact golden-rendered line ran, resolved, on the newest weights
    assert "-m sglang.launch_server --model-path" in first and "${" not in first
    assert "--skip-tokenizer-init" in first and "--enable-return-routed-experts" in first
    assert _served_version(log) >= 1            # it served, took published weights, and stopped cleanly
    node = (root / "logs" / "rollout-node" / "0.log").read_text()
    assert "engine 0 at http://127.0.0.1:" in node and "is healthy" in node
    assert node.index("is healthy") < node.index("started rollout worker 0")   # health-checked first
    assert any(e.get("event") == "weights_loaded" for e in read_metrics(root, "rollout-node"))
    assert [m["step"] for m in read_metrics(root, "trainer")] == [1, 2, 3]
    assert _left(root) == []


@pytest.mark.slow
def test_pd_disaggregation_goes_through_the_load_balancer(tmp_path):
    root = tmp_path / "run"
    r = _run(root, ["train.steps=2", "offpolicy.max_staleness=0", "engine.num_engines=2",
                    "engine.pd_disaggregation=true",
                    f"engine.port={free_port()}", f"engine.load_balancer_port={free_port()}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = root / "logs" / "engine"
    lb = (logs / "load_balancer.log").read_text()
    # the real sglang_router (not a stand-in), with the balancer that forwards routed-experts fields
    assert "-m sglang_router.launch_router --pd-disaggregation --mini-lb --prefill" in lb.splitlines()[0]
    served = []
    for i, mode in ((0, "prefill"), (1, "decode")):
        text = (logs / f"{i}.log").read_text()
        assert f'"mode": "{mode}"' in text
        served.append(int(re.search(r"served (\d+) bootstrapped", text).group(1)))
        # weights go to each engine directly (the load balancer does not forward them)
        assert _served_version(text) >= 1
    # every request reached both servers with the load balancer's bootstrap fields
    assert served[0] == served[1] > 0
    # the routes came back through the load balancer: the trainer replayed them
    steps = [m for m in read_metrics(root, "trainer") if "step" in m and "loss" in m]
    assert steps and all(m.get("replay_docs_missing", 0) == 0 for m in steps), steps
    node = (root / "logs" / "rollout-node" / "0.log").read_text()
    assert node.index("engine 1 at") < node.index("started load balancer") < node.index("load balancer at")
    assert "started rollout worker 0 (pid" in node and "on http://127.0.0.1:" in node
    from neon_hpc.ops.status import collect, render
    text = render(collect(root))
    assert re.search(r"engines   node 0: http://127.0.0.1:\d+ http://127.0.0.1:\d+ \(sglang, v_\d+\); workers via "
                     r"http://127.0.0.1:\d+", text), text
    assert _left(root) == []


@pytest.mark.slow
def test_engine_that_cannot_start_fails_the_run_with_its_log(tmp_path):
    root = tmp_path / "run"
    r = _run(root, ["train.steps=2", f"engine.port={free_port()}", "engine.extra_args=[--no-such-flag]"],
             timeout=180)
    assert r.returncode != 0
    assert "the rollout node exited (code 1)" in r.stdout
    node = (root / "logs" / "rollout-node" / "0.log").read_text()
    assert "engine 0 exited (exit code 2)" in node
    assert "unrecognized arguments: --no-such-flag" in node    # the engine log's tail, quoted
    assert str(root / "logs" / "engine" / "0.log") in node
    assert not list((root / "trajectories" / "ready").glob("*.h5"))
    assert _left(root) == []


@pytest.mark.slurm
@pytest.mark.slow
def test_multi_node_engine_in_a_het_job(slurm_cluster, tmp_path):
    """One engine over both rollout nodes (tp 16 at 8 GPUs a node): node 1 runs SGLang's node
    rank 1 and joins node 0's rendezvous; workers run on node 0; the job ends cleanly."""
    root = tmp_path / "run"
    env = dict(slurm_cluster.env, PYTHONPATH=STANDINS, NEON_PYTHON=sys.executable)
    r = subprocess.run(NEON + ["launch", str(TINY), "--run-dir", str(root), "--wait",
                               "--set", "engine.kind=sglang", "--set", "engine.tp_size=16",
                               "--set", "launch.rollout.nodes=2", "--set", f"engine.port={free_port()}",
                               "--set", "train.steps=3", "--set", "offpolicy.max_staleness=1",
                               "--set", "warm_start.enabled=false",
                               "--set", "eval.num_tasks=0"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = "".join(p.read_text() for p in (root / "launch").glob("neon-rl-*.out"))
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:] + out[-3000:]
    head = (root / "logs" / "engine" / "0.log").read_text()
    peer = (root / "logs" / "engine" / "0.n1.log").read_text()
    assert "--nnodes 2 --node-rank 0" in head and "--nnodes 2 --node-rank 1" in peer
    assert "node rank 1 joined (2/2)" in head and "joined" in peer
    assert _served_version(head) >= 1
    n1 = (root / "logs" / "rollout-node" / "1.log").read_text()
    assert "none serving here" in n1 and "started rollout worker" not in n1
    assert [m["step"] for m in read_metrics(root, "trainer")] == [1, 2, 3]
    # the rollout side stopped on its own (finished.json), not killed by Slurm
    for n in (0, 1):
        assert f"rollout node {n} stopped" in (root / "logs" / "rollout-node" / f"{n}.log").read_text()
    job = re.search(r"submitted heterogeneous job (\d+)", r.stdout).group(1)
    assert slurm_cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip() == ""
    assert _left(root) == []
