"""What the soak found growing, pinned down (issue 20, item 5).

The embedded engine loads a new model at every weight update. Its router hooks used to be
bound methods of the LoadedModel, so model -> hook -> LoadedModel -> model was a reference
cycle: a replaced model was freed only by a full gc collection, which on a process with
~370k objects comes hours apart (the soak measured the engine's RSS growing ~0.2 MB per
update). A replaced model must now go as soon as nothing uses it, by reference counting
alone, and routes must still be recorded."""

from __future__ import annotations

import gc
import weakref

import pytest

from neon_hpc.config.model import ModelConfig
from neon_hpc.models import hf
from neon_hpc.rollout.engines import wire
from neon_hpc.rollout.engines.embedded.model import LoadedModel
from neon_hpc.rollout.engines.embedded.scheduler import Scheduler
from neon_hpc.rollout.engines.wire import GenerateRequest, Sampling


@pytest.mark.slow
def test_a_replaced_model_is_freed_without_the_cyclic_gc_and_routes_still_record(tmp_path):
    cfg = ModelConfig()
    dirs = []
    for v, seed in ((0, 11), (1, 22)):
        hf.save_hf(hf.build_hf_model(cfg, seed=seed), cfg, tmp_path / f"v_{v}")
        dirs.append(tmp_path / f"v_{v}")
    sched = Scheduler(LoadedModel.load(dirs[0]))
    gc.collect()
    gc.disable()                    # only reference counting may free a replaced model
    try:
        refs = []
        for i in range(6):
            new = LoadedModel.load(dirs[(i + 1) % 2])
            refs.append(weakref.ref(new))
            sched.swap(new)
            del new
            (job,) = sched.submit([GenerateRequest([1, 2, 3, 4], Sampling(max_new_tokens=3, temperature=0.0),
                                                   return_routed_experts=True)])
            assert job.done.wait(120) and job.error is None, job.error
            meta = job.result["meta_info"]
            rows = wire.routed_rows(4, len(job.result["output_ids"]), 0)
            lay = sched.loaded
            routes = wire.decode_routes(meta["routed_experts"], rows, lay.route_rows, lay.top_k)
            assert routes.shape == (rows, lay.route_rows, lay.top_k)
            assert (routes[:, list(lay.route_table.moe_rows)] >= 0).all() and routes.max() < lay.num_experts
            del job
        alive = [i for i, r in enumerate(refs[:-1]) if r() is not None]
        assert alive == [], f"replaced models {alive} are still alive: only a cyclic gc would free them"
        assert refs[-1]() is sched.loaded
    finally:
        gc.enable()
        sched.close()
