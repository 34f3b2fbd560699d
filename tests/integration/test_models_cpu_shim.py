"""The CPU shim for megatron-core: each patch has the effect its docstring line promises.

Runs in a fresh interpreter (the shim patches process-wide state; the test process stays clean).
"""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(r"""
    import json, sys, torch
    import neon_hpc.models.hf, neon_hpc.models.convert  # the HF side never needs megatron
    from neon_hpc.models import cpu_shim
    r = {}
    r["before"] = cpu_shim.applied()
    r["megatron_imported_by_hf_side"] = "megatron" in sys.modules
    first = cpu_shim.apply()
    r["idempotent"] = cpu_shim.apply() == first and cpu_shim.applied() == first
    r["names"] = first
    r["current_device"] = str(torch.zeros(1, device=torch.cuda.current_device()).device)
    torch.cuda.synchronize()
    from megatron.core.transformer import utils as tutils
    from megatron.core.fusions import fused_softmax
    m = fused_softmax.get_default_causal_mask(4)
    r["mask"] = [str(m.device), m.dtype == torch.bool, m.tolist()[0], m.tolist()[3]]
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    r["te_general_gemm_is_none"] = moe_utils.te_general_gemm is None
    split = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    r["numpy_splits"] = type(split).__module__.startswith("numpy")
    s = torch.cuda.Stream(); r["one_stream"] = s is torch.cuda.current_stream()
    with torch.cuda.stream(s):
        pass
    torch.cuda.Event().synchronize()
    # RNG tracker on the CPU generator: forked draws are reproducible and do not disturb
    # the default stream.
    from neon_hpc.models import megatron
    megatron.init_parallel(seed=5)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    outside = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3).tolist()
    r["fork_keeps_default"] = bool(torch.equal(outside, torch.get_rng_state()))
    model_parallel_cuda_manual_seed(5)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3).tolist()
    r["fork_reproducible"] = a == b
    # torch norm under sequence parallelism
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from neon_hpc.config.model import ModelConfig
    cfg = megatron.transformer_config(ModelConfig(), tp=1)
    cfg.sequence_parallel = True  # as at TP>1 (the constructor refuses SP at TP=1)
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    r["sp_norm"] = [type(norm).__name__, all(p.sequence_parallel for p in norm.parameters())]
    # megatron's jit_fuser: its decorated functions are the plain ones, torch.compile is torch's
    # again, and nothing imported inductor (dynamo neither)
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.fusions import fused_bias_swiglu
    r["jit_fuser"] = {"router_compiled": hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"),
                      "swiglu_compiled": hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"),
                      "torch_compile_restored": torch.compile.__module__ == "torch",
                      "compiler_imported": sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules)}
    print("RESULT " + json.dumps(r))
""")


@pytest.fixture(scope="module")
def shim_result():
    if torch.cuda.is_available():
        pytest.skip("the shim only applies without CUDA; this machine has a GPU")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_apply_is_idempotent_and_applies_every_patch(shim_result):
    from neon_hpc.models import cpu_shim
    assert shim_result["before"] == []
    assert shim_result["idempotent"]
    assert shim_result["names"] == list(cpu_shim.PATCHES)


def test_current_device_is_cpu(shim_result):
    assert shim_result["current_device"] == "cpu"


def test_causal_mask_built_on_cpu(shim_result):
    device, is_bool, row0, row3 = shim_result["mask"]
    assert device == "cpu" and is_bool
    assert row0 == [False, True, True, True] and row3 == [False, False, False, False]


def test_te_gemm_name_and_numpy_splits_and_streams(shim_result):
    assert shim_result["te_general_gemm_is_none"]
    assert shim_result["numpy_splits"]
    assert shim_result["one_stream"]


def test_rng_tracker_runs_on_cpu_generator(shim_result):
    assert shim_result["fork_keeps_default"]
    assert shim_result["fork_reproducible"]


def test_torch_norm_accepts_sequence_parallel_and_marks_weights(shim_result):
    assert shim_result["sp_norm"] == ["RMSNorm", True]


def test_hf_side_neither_imports_megatron_nor_applies_the_shim(shim_result):
    assert shim_result["before"] == []
    assert shim_result["megatron_imported_by_hf_side"] is False


def test_megatron_fusions_run_eagerly_and_torch_compile_is_restored(shim_result):
    assert shim_result["jit_fuser"] == {"router_compiled": False, "swiglu_compiled": False,
                                        "torch_compile_restored": True, "compiler_imported": []}
