"""The plugin as a vLLM GPU start-up builds and runs it, reproduced on the CPU (docs/facts.md#vllm-start-up).

- The impl is built inside ``set_default_torch_dtype(bf16)`` and ``torch.device("meta")`` (the
  stand-in for ``cuda``) with the self-check on, as ``load_model`` builds it.
- What ``forward_mqa`` hands each bound kernel passes every binding's own input checks, the
  FlashInfer one included (pure Python, run without a GPU), and the self-check uses that geometry.
- A fresh process with nothing but vLLM's own logging shows the plugin's two lines.
- A worker started with only the environment vLLM's Ray launcher copies still reads the TOML.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from support.cli import assert_three_parts, clean_env
from support.kernel_checks import ON_GPU
from support.model_configs import write_model
from support.vllm_engine import build_metadata, common_metadata, make_impl, make_vllm_config, vllm_log

from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.dispatch import forward as api, flashinfer, selfcheck, selfcheck_dsa
from mla_sm120_plugin.kernels.dsa import layout, pack
from mla_sm120_plugin.dispatch.binding import BoundKernel
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON, TRITON_FAST
from mla_sm120_plugin.types import DECODE, PREFILL

HEADS, TOPK = 5, 100


@pytest.fixture
def tp1(monkeypatch):
    import vllm.model_executor.layers.attention.sparse_mla_attention as sma

    monkeypatch.setattr(sma, "get_tensor_model_parallel_world_size", lambda: 1)


@pytest.mark.self_check
def test_impl_self_checks_inside_vllms_construction_context(tmp_path, tp1):
    """Default self-check mode, bf16 default dtype, meta default device: the check runs, passes
    and says so on vLLM's console."""
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS), enforce_eager=True)
    with vllm_log() as messages:
        impl = make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype="fp8_ds_mla", load_device="meta")
    (line,) = [m for m in messages if m.startswith("mla_sm120: self-check:")]
    for phase in (DECODE, PREFILL):
        assert f"{phase}={impl._mla_sm120_kernels[phase].name} ok (cos_diff " in line, line
    assert line.count("bound cos_diff <= 5e-06, relRMS <= 0.30%") == 2, line  # both phases at exact class
    assert impl._mla_sm120_kernels[DECODE].name == (TRITON_FAST if not ON_GPU else impl.decision.decode)
    assert torch.get_default_dtype() == torch.float32  # the check restored what it changed


def _cuda_device_this_process_cannot_use(monkeypatch) -> torch.device:
    """The engine says its device is CUDA, and allocating there fails (no driver here; on a GPU
    machine, an ordinal past the last GPU)."""
    if ON_GPU:
        return torch.device("cuda", torch.cuda.device_count() + 7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return torch.device("cuda", 0)


def test_a_case_the_device_cannot_hold_fails_the_check_with_a_reason(monkeypatch):
    from mla_sm120_plugin.dispatch.binding import bind

    device = _cuda_device_this_process_cannot_use(monkeypatch)
    result = selfcheck.check(bind(TORCH), phase=DECODE, kv_layout=layout.FP8_DS_MLA,
                             scale_format=layout.SCALE_ARBITRARY, num_heads=HEADS, topk=TOPK, device=device)
    assert not result.passed and not result.ran and result.max_error is None
    assert result.error.startswith(f"could not build the self-check case on {device}: "), result.error


@pytest.mark.self_check
def test_the_impl_refuses_with_the_reason_instead_of_crashing(tmp_path, tp1, monkeypatch):
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS), enforce_eager=True)
    if ON_GPU:
        monkeypatch.setattr(selfcheck, "engine_device", lambda: torch.device("cuda", torch.cuda.device_count() + 7))
    else:
        _cuda_device_this_process_cannot_use(monkeypatch)
    with pytest.raises(UnsupportedConfiguration) as err:
        make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype="fp8_ds_mla", load_device="meta")
    assert "could not build the self-check case on cuda" in str(err.value)
    assert_three_parts(str(err.value))


# --------------------------------------------------------------- what the kernels are handed

PAGE, STRIDE_ROWS, NUM_BLOCKS = 64, 128, 6
BATCHES = {
    "decode": ([1, 1, 1], [70, 130, 5], [[3, 5, 0], [1, 2, 0], [4, 0, 0]]),
    "prefill over 64 tokens": ([70], [100], [[2, 5, 0]]),
    "mixed": ([1, 1, 67, 3], [70, 130, 67, 66], [[3, 5, 0], [1, 2, 0], [4, 0, 0], [0, 1, 0]]),
}


def _spy(bound: BoundKernel, seen: list) -> BoundKernel:
    def fn(q, kv_cache, indices, **kwargs):
        seen.append((q, kv_cache, indices, kwargs))
        return bound.fn(q, kv_cache, indices, **kwargs)

    return BoundKernel(bound.name, fn, bound.takes_scale_format, bound.needs_scale_format, bound.graph_safe)


def _assert_every_binding_takes(q, kv_cache, indices, kwargs, kv_dtype) -> None:
    """The tensors pass the public contract's validation and, for the fp8 cache, the FlashInfer
    binding's own checks (geometry: 64-row pages; minus only its CUDA-device requirement)."""
    api._validate(q, kv_cache, indices, sm_scale=kwargs["sm_scale"], kv_layout=kwargs["kv_layout"],
                  topk_length=kwargs.get("topk_length"), page_size=kv_cache.shape[1], out=kwargs.get("out"),
                  return_lse=False, lse_base="e", lse_with_sink=False, sink=None, scale_format=kwargs.get("scale_format"))
    assert kv_cache.dim() == 3 and kv_cache.shape[1] == layout.PAGE_SIZE, tuple(kv_cache.shape)
    if kv_dtype == "fp8_ds_mla":
        pages = flashinfer.check_inputs(q.to(torch.bfloat16), kv_cache, indices, topk_length=kwargs.get("topk_length"),
                                        require_cuda=False)
        assert pages.data_ptr() == kv_cache.data_ptr() and pages.shape == kv_cache.shape


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "bfloat16"])
def test_forward_hands_every_binding_64_row_pages(tmp_path, cpu_vllm, kv_dtype, batch):
    q_lens, seq_lens, block_table = BATCHES[batch]
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS), cache_dtype=kv_dtype,
                          enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": TRITON, "prefill_kernel": TORCH}})
    impl = make_impl(vc, heads=HEADS, topk=TOPK, kv_cache_dtype=kv_dtype, load_device="cpu")
    md = build_metadata(vc, kv_dtype, TOPK, common_metadata(q_lens, seq_lens, block_table, page=PAGE,
                                                            stride_rows=STRIDE_ROWS))
    seen: list = []
    impl._mla_sm120_kernels = {phase: _spy(bound, seen) for phase, bound in impl._mla_sm120_kernels.items()}
    width = 656 if kv_dtype == "fp8_ds_mla" else 576
    dtype = torch.uint8 if kv_dtype == "fp8_ds_mla" else torch.bfloat16
    kv_cache = torch.zeros(NUM_BLOCKS, STRIDE_ROWS, width, dtype=dtype)[:, :PAGE]  # pages 128 rows apart
    n = sum(q_lens)
    impl.topk_indices_buffer[:n] = torch.arange(TOPK, dtype=torch.int32).remainder(min(seq_lens))[None, :]
    q = (torch.zeros(n, HEADS, 512, dtype=torch.bfloat16), torch.zeros(n, HEADS, 64, dtype=torch.bfloat16))
    impl.forward_mqa(q, kv_cache, md, layer=None)
    expected_calls = 1 if md.num_decode_tokens in (0, n) else 2
    assert len(seen) == expected_calls
    for q_t, cache_t, indices_t, kwargs in seen:
        _assert_every_binding_takes(q_t, cache_t, indices_t, kwargs, kv_dtype)
    if batch == "prefill over 64 tokens":
        assert seen[0][0].shape[0] == 70  # FlashInfer's prefill path, not its decode kernel


@pytest.mark.parametrize("phase", [DECODE, PREFILL])
@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "bf16"])
def test_the_self_check_case_has_the_engines_geometry(kv_dtype, phase):
    key = selfcheck.CheckKey("k", phase, kv_dtype, HEADS, "cpu", "bf16", "arbitrary", "arbitrary", TOPK)
    case = selfcheck_dsa.build(key, torch.device("cpu"))
    kwargs = dict(sm_scale=case["sm_scale"], kv_layout=kv_dtype, topk_length=case["topk_length"])
    _assert_every_binding_takes(case["q"], case["kv_cache"], case["indices"], kwargs, kv_dtype)
    # The adversarial ids are in the case: padding, out of range (just past and far past), a duplicate.
    num_slots = case["kv_cache"].shape[0] * case["kv_cache"].shape[1]
    row0 = case["indices"][0].tolist()
    assert row0[:4] == [-1, num_slots, num_slots + 1000, 3] and row0[5] == row0[4]
    if case["q"].shape[0] > 1:
        assert case["topk_length"][1] < TOPK  # a short valid prefix


def test_flashinfer_takes_flat_rows_only_as_whole_pages():
    rows = pack.quantize_fp8_ds_mla(torch.randn(3 * 64, 576), "arbitrary")
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    assert tuple(flashinfer.check_inputs(q, rows, idx, require_cuda=False).shape) == (3, 64, 656)
    from mla_sm120_plugin.errors import KernelInputError

    with pytest.raises(KernelInputError, match=r"(?s)flat kv_cache \(190, 656\).*whole\s+64-row pages"):
        flashinfer.check_inputs(q, rows[:190], idx, require_cuda=False)


# ------------------------------------------------------------------------- fresh processes

LOGGING_PROBE = """
import sys
import vllm.model_executor.layers.attention.sparse_mla_attention as sma
from vllm.logger import configure_logging
from support.model_configs import write_model
from support.vllm_engine import make_impl, make_vllm_config

vc = make_vllm_config(write_model(sys.argv[1], "glm", index_topk=100, heads=5), enforce_eager=True)
configure_logging(vc.logging_config)  # a vLLM worker's first step (multiproc/Ray executors)
sma.PIN_MEMORY = False  # the CPU stand-ins a GPU worker does not need
sma.get_tensor_model_parallel_world_size = lambda: 1
make_impl(vc, heads=5, topk=100, kv_cache_dtype="fp8_ds_mla", load_device="meta")
"""


def test_a_fresh_vllm_process_shows_both_lines_on_its_console(tmp_path):
    env = clean_env() if ON_GPU else clean_env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", LOGGING_PROBE, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    console = res.stdout + res.stderr
    decision = [line for line in console.splitlines() if "mla_sm120: model=" in line]
    check = [line for line in console.splitlines() if "mla_sm120: self-check:" in line]
    assert len(decision) == 1 and len(check) == 1, console[-3000:]
    assert " INFO " in decision[0] and "prefill=" in decision[0]  # in vLLM's own format, at INFO


DRIVER = """
import json, os
from vllm.plugins import load_general_plugins
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

load_general_plugins()  # the API server loads plugins before it starts any engine core
names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, destination="EngineCoreActor")
print(json.dumps({name: os.environ[name] for name in names if name in os.environ}))
"""

WORKER = """
import pickle, sys
from vllm.config import set_current_vllm_config
from vllm.plugins import load_general_plugins
from support.vllm_engine import selector_kwargs

vc = pickle.load(open(sys.argv[1], "rb"))  # the config object every worker receives
load_general_plugins()  # as vLLM's WorkerBase does
from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, decide

with set_current_vllm_config(vc):
    assert MlaSm120Backend.validate_configuration(**selector_kwargs("fp8_ds_mla", (12, 0))) == []
print(decide(vc, "fp8_ds_mla", 12, 0).scale_format)  # the plan validate_configuration made, from its cache
"""


def test_the_toml_reaches_a_worker_started_with_only_what_ray_copies(tmp_path):
    toml = tmp_path / "mla_sm120.toml"
    toml.write_text('[architectures.GlmMoeDsaForCausalLM]\nkv_scale_format = "pow2"\n')
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=TOPK, heads=HEADS), enforce_eager=True)
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(vc))

    driver = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300,
                            env=clean_env(MLA_SM120_CONFIG=str(toml)))
    assert driver.returncode == 0, driver.stderr[-3000:]
    copied = json.loads(driver.stdout.strip().splitlines()[-1])
    assert copied.get("MLA_SM120_CONFIG") == str(toml), sorted(copied)

    def decide(extra: dict[str, str]) -> str:
        worker = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "config.pkl")], capture_output=True,
                                text=True, timeout=300, env=clean_env(**extra))
        assert worker.returncode == 0, worker.stderr[-3000:]
        return worker.stdout.strip().splitlines()[-1]

    assert decide(copied) == "pow2"  # the TOML's setting, not GLM's own "arbitrary"
    assert decide({}) == "arbitrary"  # what the worker would decide without it
