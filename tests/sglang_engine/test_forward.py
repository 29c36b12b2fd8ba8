"""The plugin's kernels through SGLang's real DSA call site, on caches SGLang's own writer packed.

SGLang's ``DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla`` is called unbound with the
attributes it reads (its constructor needs a GPU model runner); the cache comes from SGLang's
``quantize_k_cache`` (fp8: amax/448 scales) or is SGLang's bf16 pool layout; the indices from its
``transform_index_page_table_decode``; the phase from the hooked ``forward_decode`` /
``forward_extend`` entry points with SGLang's own ``ForwardMode``.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from support.model_configs import write_model
from support.oracle import sparse_attention
from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache
from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode
from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache
from sglang.srt.arg_groups import overrides
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

from mla_sm120_plugin.errors import KernelInputError, UnsupportedConfiguration
from mla_sm120_plugin.integration import sglang as plugin
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON, TRITON_FAST, TRITON_FAST_SPEC
from mla_sm120_plugin.kernels.dsa.triton import triton_sparse_mla

HEADS, TOPK, PAGES, SEQ = 16, 64, 4, 200  # 256 slots; every request sees 200 tokens


def _decide(tmp_path, capability, monkeypatch, kv: str, decode: str = TRITON) -> None:
    """The launcher's decision: Triton decodes (``decode``), the reference prefills (eager, so it may)."""
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, f'{{"prefill_kernel": "{TORCH}", "decode_kernel": "{decode}"}}')
    sa = ServerArgs(model_path=write_model(tmp_path, "glm", heads=HEADS), skip_tokenizer_init=True,
                    kv_cache_dtype=kv, disable_cuda_graph=True)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)


def _sglang_cache(kv: str, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """SGLang's pool buffer for one layer: [slots, 1, 656] fp8 bytes or [slots, 1, 576] bf16."""
    k = (torch.randn(PAGES, layout.PAGE_SIZE, 1, layout.HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    if kv == "fp8_e4m3":
        packed = quantize_k_cache(k)  # SGLang's own writer
        return packed.view(-1, 1, layout.FP8_DS_MLA_TOKEN_BYTES), layout.FP8_DS_MLA_TOKEN_BYTES
    return k.view(-1, 1, layout.HEAD_DIM), layout.HEAD_DIM


def _sglang_slots(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions per token (valid prefix, -1 after, one out-of-range) through SGLang's transform."""
    page_table = torch.stack([torch.randperm(PAGES * layout.PAGE_SIZE, generator=gen)[:SEQ]
                              for _ in range(num_tokens)]).to(torch.int32)  # [T, SEQ] position -> slot
    lengths = torch.randint(1, TOPK + 1, (num_tokens,), generator=gen, dtype=torch.int32)
    lengths[0] = TOPK
    topk = torch.full((num_tokens, TOPK), -1, dtype=torch.int32)
    for t in range(num_tokens):
        topk[t, : lengths[t]] = torch.randperm(SEQ, generator=gen)[: lengths[t]].to(torch.int32)
    slots = transform_index_page_table_decode(page_table, topk, page_size=1)
    return slots, lengths


def _dense_reference(q, cache, kv, slots, lengths, sm_scale) -> torch.Tensor:
    """Attention in float64 (tests/support/oracle.py) over the slots each row selects, on SGLang's own
    dequantization of its cache."""
    keys = (dequantize_k_cache(cache) if kv == "fp8_e4m3" else cache).view(-1, layout.HEAD_DIM).double()
    return sparse_attention(q, keys, slots, sm_scale, topk_length=lengths)[0]


def _through_sglang(phase_entry, mode, q, cache, dim, slots, lengths, sm_scale):
    backend = types.SimpleNamespace(  # the attributes SGLang's call site reads from its backend
        workspace_buffer=torch.empty(0, dtype=torch.uint8), physical_page_size=layout.PAGE_SIZE, kv_cache_dim=dim,
        qk_nope_head_dim=192, kv_lora_rank=layout.KV_LORA_RANK, qk_rope_head_dim=layout.ROPE_DIM)

    def sglang_forward(*_args, **_kwargs):
        return DeepseekSparseAttnBackend._forward_flashinfer_sparse_mla(
            backend, q_all=q, kv_cache=cache, page_table_1=slots, seq_lens=lengths, sm_scale=sm_scale,
            skip_softmax_threshold_scale_factor=None)

    batch = types.SimpleNamespace(forward_mode=mode)
    # forward_* (self, q, k, v, layer, forward_batch): the hook reads the batch's mode.
    return phase_entry(sglang_forward, None, q, None, None, None, batch)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("entry, mode, kernel", [
    ("forward_decode", ForwardMode.DECODE, TRITON),
    ("forward_extend", ForwardMode.TARGET_VERIFY, TRITON),  # speculative verify counts as decode
    ("forward_extend", ForwardMode.EXTEND, TORCH),
])
def test_forward_matches_the_reference(tmp_path, capability, monkeypatch, kv, entry, mode, kernel):
    _decide(tmp_path, capability, monkeypatch, kv)
    gen = torch.Generator().manual_seed(7)
    cache, dim = _sglang_cache(kv, gen)
    num_tokens = 5
    q = torch.randn(num_tokens, HEADS, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots, lengths = _sglang_slots(num_tokens, gen)
    slots[1, 0] = PAGES * layout.PAGE_SIZE + 5  # out of range: masked, never read
    sm_scale = 1 / math.sqrt(layout.HEAD_DIM)
    phase_entry = getattr(dsa, f"around_{entry}")
    ran: list = []
    _spy_on_bound_kernels(ran)
    out = _through_sglang(phase_entry, mode, q, cache, dim, slots, lengths, sm_scale)
    assert out.shape == (num_tokens, HEADS, layout.KV_LORA_RANK) and out.dtype == torch.bfloat16
    # The phase reached the kernel the decision bound for it.
    assert [kernel_name for kernel_name, *_ in ran] == [kernel]
    # Against attention computed independently on SGLang's own dequantization. The difference is
    # the bf16 output's rounding and bf16 dot operands plus SGLang's dequantization to bf16 (the
    # kernels dequantize to fp32): measured 2.7e-3 to 1.0e-2.
    dense = _dense_reference(q, cache, kv, slots, lengths, sm_scale)
    err = ((out.double() - dense).abs().max() / dense.abs().max()).item()
    print(f"\nmax |out - dense| / max |dense|, {kv} {mode.name} ({kernel}): {err:.2e}")
    assert err < 2e-2
    # And against float64 over the rows exactly as the bytes hold them, in the kernel's own bound.
    from support.layout_oracle import decode_cache

    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.kernels.accuracy import measure

    keys = decode_cache(cache, layout.FP8_DS_MLA) if kv == "fp8_e4m3" else cache.view(-1, layout.HEAD_DIM).double()
    exact, _ = sparse_attention(q, keys, slots, sm_scale, topk_length=lengths)
    got = measure(out, exact)
    assert not get_registry().kernels[kernel].accuracy.violations(got), got


@pytest.mark.parametrize("entry, mode", [("forward_decode", ForwardMode.DECODE),
                                         ("forward_extend", ForwardMode.TARGET_VERIFY)])
def test_the_fast_kernel_through_sglang_is_exact_class(tmp_path, capability, monkeypatch, entry, mode):
    """The fp8-MMA kernel on a cache SGLang's own writer packed, through SGLang's call site (per-row
    lengths, its index transform), against float64 attention over the rows exactly as the bytes
    hold them (tests/support/layout_oracle.py): within its declared exact-class bound."""
    from support.layout_oracle import decode_cache

    from mla_sm120_plugin.kernels.accuracy import EXACT_COS_DIFF, EXACT_REL_RMS, measure

    _decide(tmp_path, capability, monkeypatch, "fp8_e4m3", decode=TRITON_FAST)
    gen = torch.Generator().manual_seed(13)
    cache, dim = _sglang_cache("fp8_e4m3", gen)
    q = torch.randn(5, HEADS, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots, lengths = _sglang_slots(5, gen)
    ran: list = []
    _spy_on_bound_kernels(ran)
    sm_scale = 0.135  # DeepSeek-V3.2's: a peaked softmax
    out = _through_sglang(getattr(dsa, f"around_{entry}"), mode, q, cache, dim, slots, lengths, sm_scale)
    assert [kernel_name for kernel_name, *_ in ran] == [TRITON_FAST]
    expected, _ = sparse_attention(q, decode_cache(cache, layout.FP8_DS_MLA), slots, sm_scale, topk_length=lengths)
    got = measure(out, expected)
    assert not TRITON_FAST_SPEC.accuracy.violations(got), got
    assert got.cos_diff <= EXACT_COS_DIFF and got.rel_rms <= EXACT_REL_RMS, got


def test_validator_takes_the_launchers_decision(tmp_path, capability, monkeypatch):
    from sglang.kernels.ops.attention import flash_mla_sm120

    _decide(tmp_path, capability, monkeypatch, "bfloat16")
    args = dict(model_arch="DeepseekV32ForCausalLM", device_sm_major=12, kv_cache_dtype=torch.bfloat16,
                prefill_impl=dsa.ROUTE, decode_impl=dsa.ROUTE)
    # SGLang alone refuses what the plugin serves (it knows GLM + fp8 only) ...
    with pytest.raises(ValueError, match="supports only GLM DSA with FP8"):
        flash_mla_sm120._validate_flashinfer_sparse_mla_backend.__wrapped__(**args)
    # ... with the plugin, the launcher's decision stands, and the kernels are bound and checked.
    assert flash_mla_sm120._validate_flashinfer_sparse_mla_backend(**args) is True
    bound = dsa.bound_state().kinds[dsa.KIND]
    assert (bound.kernels["prefill"].name, bound.kernels["decode"].name) == (TORCH, TRITON)


def test_validator_without_a_launcher_decision_says_how_to_start(monkeypatch):
    from sglang.kernels.ops.attention import flash_mla_sm120

    with pytest.raises(UnsupportedConfiguration, match="did not reach it"):
        flash_mla_sm120._validate_flashinfer_sparse_mla_backend(
            model_arch="GlmMoeDsaForCausalLM", device_sm_major=12, kv_cache_dtype=torch.float8_e4m3fn,
            prefill_impl=dsa.ROUTE, decode_impl=dsa.ROUTE)


def test_skip_softmax_at_the_call_is_refused(tmp_path, capability, monkeypatch):
    from sglang.kernels.ops.attention import flash_mla_sm120

    _decide(tmp_path, capability, monkeypatch, "bfloat16")
    q = torch.zeros(1, HEADS, layout.HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="skip_softmax_threshold_scale_factor=0.5"):
        flash_mla_sm120.flashinfer_sparse_mla_forward(
            q, torch.zeros(64, 1, layout.HEAD_DIM, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), None, page_size=64, kv_cache_dim=576, qk_nope_head_dim=192,
            kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1, skip_softmax_threshold_scale_factor=0.5)


def test_without_the_opt_in_the_call_is_sglangs(monkeypatch):
    from sglang.kernels.ops.attention import flash_mla_sm120

    monkeypatch.delenv(names.ENABLE_ENV)
    q = torch.zeros(1, HEADS, layout.HEAD_DIM, dtype=torch.bfloat16)
    # SGLang's own body runs: it reaches FlashInfer's trtllm entry, which needs a GPU here.
    with pytest.raises(Exception) as err:
        flash_mla_sm120.flashinfer_sparse_mla_forward(
            q, torch.zeros(64, 1, 656, dtype=torch.uint8), torch.zeros(1, 8, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), torch.zeros(16, dtype=torch.uint8), page_size=64, kv_cache_dim=656,
            qk_nope_head_dim=192, kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1,
            skip_softmax_threshold_scale_factor=None)
    assert "mla_sm120" not in str(err.value)
    assert any("flashinfer" in (frame.filename or "") for frame in __import__("traceback").extract_tb(err.tb)), \
        "SGLang's own call did not reach FlashInfer"


# ------------------------------------------------- what SGLang's call site hands the kernels


def _spy_on_bound_kernels(seen: list) -> None:
    from mla_sm120_plugin.dispatch.binding import BoundKernel

    kernels = dsa.bound_state().kinds[dsa.KIND].kernels
    for phase, bound in list(kernels.items()):
        def fn(q, kv_cache, indices, _inner=bound.fn, _name=bound.name, **kwargs):
            seen.append((_name, q, kv_cache, indices, kwargs))
            return _inner(q, kv_cache, indices, **kwargs)

        kernels[phase] = BoundKernel(bound.name, fn, bound.takes_scale_format, bound.needs_scale_format,
                                           bound.graph_safe)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("entry, mode, num_tokens", [
    ("forward_decode", ForwardMode.DECODE, 5),
    ("forward_extend", ForwardMode.EXTEND, 70),  # a prefill over 64 tokens: FlashInfer's prefill path
])
def test_the_call_site_hands_every_binding_64_row_pages(tmp_path, capability, monkeypatch, kv, entry, mode,
                                                        num_tokens):
    from mla_sm120_plugin.dispatch import forward as api, flashinfer

    _decide(tmp_path, capability, monkeypatch, kv)
    gen = torch.Generator().manual_seed(3)
    cache, dim = _sglang_cache(kv, gen)
    q = torch.randn(num_tokens, HEADS, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots, lengths = _sglang_slots(num_tokens, gen)
    seen: list = []
    _spy_on_bound_kernels(seen)
    _through_sglang(getattr(dsa, f"around_{entry}"), mode, q, cache, dim, slots, lengths, 0.1)
    ((_, q_k, cache_k, indices_k, kwargs),) = seen
    assert cache_k.dim() == 3 and cache_k.shape[1] == layout.PAGE_SIZE and cache_k.data_ptr() == cache.data_ptr()
    api._validate(q_k, cache_k, indices_k, sm_scale=kwargs["sm_scale"], kv_layout=kwargs["kv_layout"],
                  topk_length=kwargs["topk_length"], page_size=layout.PAGE_SIZE, out=None, return_lse=False,
                  lse_base="e", lse_with_sink=False, sink=None, scale_format=kwargs.get("scale_format"))
    if kv == "fp8_e4m3":
        flashinfer.check_inputs(q_k, cache_k, indices_k, topk_length=kwargs["topk_length"], require_cuda=False)


def test_lengths_for_other_rows_are_not_used(tmp_path, capability, monkeypatch):
    """SGLang drops its per-row lengths when their count differs from q's rows (DP/CP padding);
    a kernel given them would read past the shorter tensor."""
    _decide(tmp_path, capability, monkeypatch, "fp8_e4m3")
    gen = torch.Generator().manual_seed(5)
    cache, dim = _sglang_cache("fp8_e4m3", gen)
    q = torch.randn(5, HEADS, layout.HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots, lengths = _sglang_slots(5, gen)
    out = _through_sglang(dsa.around_forward_decode, ForwardMode.DECODE, q, cache, dim, slots, lengths[:3], 0.1)
    rows = cache.view(torch.uint8).view(-1, dim)
    full_width = triton_sparse_mla(q, rows, slots, sm_scale=0.1, kv_layout=layout.FP8_DS_MLA)
    assert torch.equal(out, full_width)


def test_sglangs_flashinfer_workspace_is_not_allocated(tmp_path, capability, monkeypatch):
    import inspect

    from sglang.kernels.ops.attention import flash_mla_sm120
    from sglang.srt.runtime_context import get_buffer

    # The name SGLang's DSA backend takes its FlashInfer workspace under, right after the validator.
    assert f'"{dsa.WORKSPACE_BUFFER}"' in inspect.getsource(DeepseekSparseAttnBackend.__init__)
    _decide(tmp_path, capability, monkeypatch, "fp8_e4m3")
    assert flash_mla_sm120._validate_flashinfer_sparse_mla_backend(
        model_arch="GlmMoeDsaForCausalLM", device_sm_major=12, kv_cache_dtype=torch.float8_e4m3fn,
        prefill_impl=dsa.ROUTE, decode_impl=dsa.ROUTE) is True

    def allocate():
        raise AssertionError("SGLang's 384 MiB workspace was allocated")

    workspace = get_buffer(dsa.WORKSPACE_BUFFER, allocate)
    assert workspace is not None and workspace.numel() == 0
