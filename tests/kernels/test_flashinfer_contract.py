"""The FlashInfer binding against the real installed flashinfer, on a machine without a GPU.

No part of flashinfer is mocked: the arguments the binding builds are bound to the installed
wrapper's real signature, the envelope is read from the installed table, and the probe looks at
this machine. The numerical test vs the reference is GPU-only: tests/gpu/test_flashinfer_sm120.py.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "flashinfer", reason="flashinfer-python is not installed (pip install mla-sm120-plugin[flashinfer])"
)

import torch  # noqa: E402

from mla_sm120_plugin.errors import KernelInputError, KernelUnavailable  # noqa: E402
from mla_sm120_plugin.kernels import flashinfer as fi_binding  # noqa: E402
from mla_sm120_plugin.kernels import layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HEADS = (4, 64, 128)
TOPKS = (2048, 1024, 512, 100)
TOKENS = (1, 64, 65, 512)


@pytest.fixture(autouse=True)
def _fresh_binding_caches():
    fi_binding.clear_caches()
    yield
    fi_binding.clear_caches()


def _wrapper_cls():
    import flashinfer.mla

    return flashinfer.mla.SparseMLASm120Wrapper


def _cpu_call_tensors(num_tokens=3, num_heads=16, topk=128, pages=4):
    q = torch.zeros(num_tokens, num_heads, layout.HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(pages, layout.PAGE_SIZE, layout.FP8_DS_MLA_TOKEN_BYTES, dtype=torch.uint8)
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int32)
    out = torch.empty(num_tokens, num_heads, layout.KV_LORA_RANK, dtype=torch.bfloat16)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32)
    return q, kv, indices, out, lse


# ---------------------------------------------------------------- (a) call contract


@pytest.mark.parametrize("with_options", [False, True], ids=["plain", "topk_length+sink+lse"])
def test_run_kwargs_bind_to_installed_wrapper_run(with_options):
    q, kv, indices, out, lse = _cpu_call_tensors()
    kwargs = fi_binding._native_call_kwargs(
        q,
        kv,
        indices,
        out,
        sm_scale=0.0721,
        topk_length=torch.full((3,), 100, dtype=torch.int32) if with_options else None,
        sink=torch.zeros(16) if with_options else None,
        out_lse=lse if with_options else None,
        lse_scale=0.6931,
    )
    signature = inspect.signature(_wrapper_cls().run)
    bound = signature.bind(object(), **kwargs)  # raises TypeError on any unknown / missing name
    args = bound.arguments
    assert args["q"] is q and args["kv_cache"] is kv and args["indices"] is indices and args["output"] is out
    assert type(args["sm_scale"]) is float
    # The wrapper's own LSE buffer is reused call to call; the binding passes its own or none.
    assert args["return_lse"] is False
    assert "seq_lens" not in args  # FACTS §6: never a sequence length
    if with_options:
        assert args["out_lse"] is lse and args["attn_sink"] is not None and args["topk_length"] is not None


def test_wrapper_init_kwargs_bind_and_use_known_scale_formats():
    from flashinfer.mla._sparse_mla_sm120._execution import KV_SCALE_FORMATS, normalize_kv_scale_format

    signature = inspect.signature(_wrapper_cls().__init__)
    for fmt in fi_binding.NATIVE_FORMATS.values():
        kwargs = fi_binding._wrapper_init_kwargs(torch.device("cuda", 0), fmt.kv_scale_format)
        signature.bind(object(), **kwargs)
        assert fmt.kv_scale_format in KV_SCALE_FORMATS
        assert normalize_kv_scale_format(fmt.kv_scale_format) == fmt.kv_scale_format


def test_native_formats_name_installed_families():
    import flashinfer.mla

    configs = flashinfer.mla.supported_sparse_mla_sm120_configs()
    assert fi_binding.NATIVE_FORMATS[layout.SCALE_POW2].family == "dsv3_2"
    assert fi_binding.NATIVE_FORMATS[layout.SCALE_ARBITRARY].family == "glm_nsa"
    assert set(fi_binding.NATIVE_FORMATS) == set(layout.SCALE_FORMATS)
    for fmt in fi_binding.NATIVE_FORMATS.values():
        config = configs[fmt.family]
        assert config.d_qk == layout.HEAD_DIM
        assert config.bytes_per_token == layout.FP8_DS_MLA_TOKEN_BYTES


def test_mirrored_prefill_constants_match_installed_sources():
    """PREFILL_* mirror FlashInfer internals that no public API reports: pin them to the sources."""
    import flashinfer
    from flashinfer.mla._sparse_mla_sm120 import _policy

    assert fi_binding.PREFILL_TOPK_TILE == _policy._BI
    assert _policy._DECODE_MAX_TOKENS == 64
    header = (
        Path(flashinfer.__file__).parent
        / "data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h"
    ).read_text()
    body = header.split("PrefillLaunchResult visit_prefill_heads", 1)[1].split("#undef HEAD", 1)[0]
    import re

    assert {int(h) for h in re.findall(r"HEAD\((\d+)\)", body)} == fi_binding.PREFILL_HEADS


def test_supported_configs_are_pure_python_and_describe_decode():
    """What supported_sparse_mla_sm120_configs() returns in this env (no GPU, no JIT build)."""
    import flashinfer.mla

    configs = flashinfer.mla.supported_sparse_mla_sm120_configs()
    assert {"dsv3_2", "glm_nsa"} <= set(configs)
    for family in ("dsv3_2", "glm_nsa"):
        c = configs[family]
        limits = (c.max_num_tokens, c.min_topk, c.max_num_heads, c.head_counts, c.topk_is_runtime)
        assert limits == (64, 1, 128, None, True)
        assert c.supports_decode(4, 100, num_tokens=64)
        assert not c.supports_decode(4, 100, num_tokens=65)
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------- (b) envelope


def _expected_reasons(heads, topk, tokens):
    if tokens <= 64:
        return False
    return heads not in fi_binding.PREFILL_HEADS or topk % 64 != 0


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("heads", HEADS)
def test_envelope_grid(heads, topk, tokens, scale_format):
    reasons = fi_binding.envelope_reasons(
        phase="decode",
        num_heads=heads,
        topk=topk,
        max_tokens=tokens,
        kv_layout=layout.FP8_DS_MLA,
        scale_format=scale_format,
    )
    assert bool(reasons) == _expected_reasons(heads, topk, tokens), reasons
    if heads == 4 and tokens > 64:
        assert any("num_heads=4" in r and "[8, 16, 32, 64, 128]" in r for r in reasons)
    if topk == 100 and tokens > 64:
        assert any("topk=100" in r and "% 64" in r for r in reasons)


def test_bf16_layout_refused_with_reason():
    reasons = fi_binding.envelope_reasons(
        phase="decode", num_heads=64, topk=2048, max_tokens=1, kv_layout=layout.BF16, scale_format="arbitrary"
    )
    assert len(reasons) == 1
    assert "bf16" in reasons[0] and "no bf16 sparse SM120 path" in reasons[0] and layout.FP8_DS_MLA in reasons[0]


@pytest.mark.parametrize(
    ("heads", "topk", "needle"),
    [(0, 2048, "num_heads=0"), (129, 2048, "num_heads=129"), (64, 0, "topk=0")],
)
def test_heads_and_topk_limits(heads, topk, needle):
    reasons = fi_binding.envelope_reasons(
        phase="decode", num_heads=heads, topk=topk, max_tokens=1, kv_layout=layout.FP8_DS_MLA, scale_format="pow2"
    )
    assert any(needle in r for r in reasons), reasons


def test_unbounded_tokens_apply_prefill_rules():
    kwargs = dict(phase="prefill", topk=2048, max_tokens=None, kv_layout=layout.FP8_DS_MLA, scale_format="pow2")
    assert fi_binding.envelope_reasons(num_heads=64, **kwargs) == ()
    assert fi_binding.envelope_reasons(num_heads=4, **kwargs)


def test_family_and_scale_format_resolution():
    common = dict(phase="decode", num_heads=64, topk=2048, max_tokens=1, kv_layout=layout.FP8_DS_MLA)
    assert fi_binding.envelope_reasons(scale_format="auto", model_family="glm_nsa", **common) == ()
    assert fi_binding.native_format("auto", "glm_nsa").kv_scale_format == "arbitrary_fp32"
    assert fi_binding.envelope_reasons(scale_format="ue8m0", **common)
    wrong = fi_binding.envelope_reasons(scale_format="pow2", model_family="dsv4", **common)
    assert wrong and "d_qk=512" in wrong[0]
    unknown = fi_binding.envelope_reasons(scale_format="pow2", model_family="nope", **common)
    assert unknown and "dsv3_2" in unknown[0]


# ---------------------------------------------------------------------- (c) probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU; the no-GPU reason cannot appear")
def test_probe_names_missing_gpu():
    reasons = fi_binding.probe()
    assert reasons
    assert any("no CUDA GPU" in r for r in reasons), reasons
    assert fi_binding.probe() is reasons  # cached
    fi_binding.clear_caches()
    assert fi_binding.probe() == reasons


# ------------------------------------------------------------------- (d) the call


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: tests/gpu covers the call")
def test_call_without_gpu_raises_kernel_unavailable():
    q, kv, indices, _, _ = _cpu_call_tensors()
    with pytest.raises(KernelUnavailable) as info:
        fi_binding.flashinfer_sparse_mla(
            q, kv, indices, sm_scale=0.07, kv_layout=layout.FP8_DS_MLA, scale_format="pow2"
        )
    message = str(info.value)
    assert message.startswith("given: ") and "; supported: " in message and "; fix: " in message
    assert "no CUDA GPU" in message


def test_input_errors_name_the_argument(monkeypatch):
    """Input checks run after the probe; with the probe passed they name the bad argument."""
    monkeypatch.setattr(fi_binding, "probe", lambda: ())  # our probe, not flashinfer
    q, kv, indices, _, _ = _cpu_call_tensors()
    with pytest.raises(KernelInputError, match="q "):
        fi_binding.flashinfer_sparse_mla(q, kv, indices, sm_scale=0.07, kv_layout="fp8_ds_mla", scale_format="pow2")
    with pytest.raises(KernelInputError, match="sm_scale"):
        fi_binding.flashinfer_sparse_mla(
            q, kv, indices, sm_scale=torch.tensor(0.07), kv_layout="fp8_ds_mla", scale_format="pow2"
        )


def test_module_import_is_light():
    code = (
        "import sys; import mla_sm120_plugin.kernels.flashinfer as m; "
        "m.NATIVE_FORMATS; print(sorted(k for k in ('torch', 'flashinfer') if k in sys.modules))"
    )
    baseline = "import sys; import mla_sm120_plugin.kernels; print('torch' in sys.modules)"
    def run(source: str) -> str:
        done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    loaded = run(code)
    package_imports_torch = run(baseline) == "True"
    expected = "['torch']" if package_imports_torch else "[]"
    assert loaded == expected
