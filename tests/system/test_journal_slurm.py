"""A real ``scontrol requeue`` of the heterogeneous job during long episodes (issue 41): the
long-episode config submitted with ``neon-hpc launch`` to the local cluster (``env/cluster.sh``),
requeued while episodes are mid-way; the journal as the workers left it is read while the job
restarts; when the job completes every journalled episode was resumed under the uid it started
with, published once with its journalled prefix (tokens, loss mask, logprobs, per-token versions,
routes) unchanged, and consumed once (``tools/bench_requeue.py --slurm``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from repo_paths import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_requeue as br  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_requeued_job_resumes_every_journalled_episode(slurm_cluster, tmp_path):
    r = br.run_requeue(tmp_path / "run", 8, Path(slurm_cluster.root), log=lambda *_: None)
    assert r["state"] == "COMPLETED" and r["problems"] == [], r
    acc = r["requeue"]
    assert acc["episodes"] >= 2, "nothing was in flight at the requeue: the test proved nothing"
    assert acc["missing"] == [] and acc["changed"] == [] and acc["twice"] == []
    assert acc["resumed_episodes"] == acc["episodes"] and acc["kept_fraction"] >= 0.99
    assert r["all_claims_once"] and r["duplicated_tokens"] == 0
    assert r["stop_s"] <= 10
