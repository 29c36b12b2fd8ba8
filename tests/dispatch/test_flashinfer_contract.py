"""The FlashInfer binding against the real installed flashinfer; no GPU needed.

No part of flashinfer is mocked: the arguments the binding builds are bound to the installed
wrapper's real signature, the packaged envelope table (dispatch/flashinfer_envelope.json) is compared
field by field with what the installed flashinfer reports, the envelope is checked against both, and
the probe looks at this machine. The numerical test vs the reference is GPU-only:
tests/gpu/test_flashinfer_sm120.py. Table logic that needs no flashinfer: test_flashinfer_table.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import clean_env

pytest.importorskip(
    "flashinfer", reason="flashinfer-python is not installed (pip install mla-sm120-plugin[flashinfer])"
)

import torch  # noqa: E402

from mla_sm120_plugin.errors import KernelInputError, KernelUnavailable  # noqa: E402
from mla_sm120_plugin.dispatch import flashinfer as fi_binding  # noqa: E402
from mla_sm120_plugin.dispatch import flashinfer_table
from mla_sm120_plugin.kernels.dsa import layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HEADS = (4, 64, 128)
TOPKS = (2048, 1024, 512, 100)
TOKENS = (1, 64, 65, 512)
SOURCES = (fi_binding.PACKAGED, fi_binding.LIVE, fi_binding.BOTH)


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
    assert "seq_lens" not in args  # docs/facts.md#flashinfer-sm120-sparse-mla: never a sequence length
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


# ------------------------------------------------------- (b) the packaged table


def test_installed_version_has_a_packaged_table():
    installed = flashinfer_table.installed_version()
    assert installed in flashinfer_table.packaged_versions(), (
        f"flashinfer-python {installed} has no table in {flashinfer_table.DATA_FILE.name}: "
        f"run {flashinfer_table.REGENERATE}"
    )
    assert flashinfer_table.table().flashinfer_version == installed
    assert flashinfer_table.table_note() is None


def test_packaged_decode_table_equals_installed_configs():
    """Every field of every family of supported_sparse_mla_sm120_configs(), and the derived head set."""
    import flashinfer.mla

    live = flashinfer.mla.supported_sparse_mla_sm120_configs(kv_cache_format="fp8")
    entry = flashinfer_table.packaged_entries()[flashinfer_table.installed_version()]
    packaged = flashinfer_table.table().decode
    assert sorted(entry["decode"]) == sorted(live) == sorted(packaged)
    for family, config in live.items():
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            stored = entry["decode"][family].get(field.name, "<missing>")
            expected = sorted(value) if isinstance(value, frozenset) else value
            assert stored == expected, f"{family}.{field.name}: packaged {stored!r}, flashinfer {expected!r}"
            assert getattr(packaged[family], field.name) == value, f"{family}.{field.name} as loaded"
        assert packaged[family].supported_num_heads() == config.supported_num_heads(), family


def test_packaged_prefill_facts_match_installed_sources():
    """The prefill facts mirror FlashInfer internals that no public API reports: pin them to the sources."""
    import flashinfer
    from flashinfer.mla._sparse_mla_sm120 import _policy

    table = flashinfer_table.table()
    assert table.prefill_topk_tile == _policy._BI
    assert _policy._DECODE_MAX_TOKENS == 64
    header = (
        Path(flashinfer.__file__).parent
        / "data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h"
    ).read_text()
    body = header.split("PrefillLaunchResult visit_prefill_heads", 1)[1].split("#undef HEAD", 1)[0]
    assert {int(h) for h in re.findall(r"HEAD\((\d+)\)", body)} == table.prefill_heads


def test_dump_reproduces_the_packaged_entry():
    """What --write would store for the installed version is what is stored."""
    version, entry = flashinfer_table.dump_entry()
    assert version == flashinfer_table.installed_version()
    assert entry == flashinfer_table.packaged_entries()[version]


def test_supported_configs_are_pure_python_and_describe_decode():
    """What supported_sparse_mla_sm120_configs() returns in this env (no GPU, no JIT build)."""
    import flashinfer.mla

    cuda_before = torch.cuda.is_initialized()
    configs = flashinfer.mla.supported_sparse_mla_sm120_configs()
    assert {"dsv3_2", "glm_nsa"} <= set(configs)
    for family in ("dsv3_2", "glm_nsa"):
        c = configs[family]
        limits = (c.max_num_tokens, c.min_topk, c.max_num_heads, c.head_counts, c.topk_is_runtime)
        assert limits == (64, 1, 128, None, True)
        assert c.supports_decode(4, 100, num_tokens=64)
        assert not c.supports_decode(4, 100, num_tokens=65)
    if not cuda_before:  # an earlier test in this process may have started CUDA on a GPU machine
        assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------- (c) envelope


def _expected_reasons(heads, topk, tokens):
    """Calls over 64 tokens run the prefill kernels: only their head set limits them (a top-k that
    is no multiple of the 64-entry tile is padded with -1 by the binding: ``pad_to_tiles``)."""
    if tokens <= 64:
        return False
    return heads not in flashinfer_table.table().prefill_heads


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("heads", HEADS)
def test_envelope_grid(heads, topk, tokens, scale_format, source):
    reasons = fi_binding.envelope_reasons(
        phase="decode",
        num_heads=heads,
        topk=topk,
        max_tokens=tokens,
        kv_layout=layout.FP8_DS_MLA,
        scale_format=scale_format,
        source=source,
    )
    assert bool(reasons) == _expected_reasons(heads, topk, tokens), reasons
    if heads == 4 and tokens > 64:
        assert any("num_heads=4" in r and "[8, 16, 32, 64, 128]" in r for r in reasons)
    assert not any("% 64" in r for r in reasons), reasons


@pytest.mark.parametrize("source", SOURCES)
def test_bf16_layout_refused_with_reason(source):
    reasons = fi_binding.envelope_reasons(
        phase="decode",
        num_heads=64,
        topk=2048,
        max_tokens=1,
        kv_layout=layout.BF16,
        scale_format="arbitrary",
        source=source,
    )
    assert len(reasons) == 1
    assert "bf16" in reasons[0] and "no bf16 sparse SM120 path" in reasons[0] and layout.FP8_DS_MLA in reasons[0]


@pytest.mark.parametrize(
    ("heads", "topk", "needle"),
    [(0, 2048, "num_heads=0"), (129, 2048, "num_heads=129"), (64, 0, "topk=0")],
)
@pytest.mark.parametrize("source", SOURCES)
def test_heads_and_topk_limits(heads, topk, needle, source):
    reasons = fi_binding.envelope_reasons(
        phase="decode",
        num_heads=heads,
        topk=topk,
        max_tokens=1,
        kv_layout=layout.FP8_DS_MLA,
        scale_format="pow2",
        source=source,
    )
    assert any(needle in r for r in reasons), reasons


def test_unbounded_tokens_apply_prefill_rules():
    kwargs = dict(phase="prefill", topk=2048, max_tokens=None, kv_layout=layout.FP8_DS_MLA, scale_format="pow2")
    assert fi_binding.envelope_reasons(num_heads=64, **kwargs) == ()
    assert fi_binding.envelope_reasons(num_heads=4, **kwargs)


def _marked_table(table, **families):
    """``table`` with some families' head limit changed, to see which family a check reads."""
    decode = dict(table.decode)
    for family, max_heads in families.items():
        decode[family] = dataclasses.replace(decode[family], max_num_heads=max_heads)
    return dataclasses.replace(table, decode=decode)


@pytest.mark.parametrize(("scale_format", "family"), [("pow2", "dsv3_2"), ("arbitrary", "glm_nsa")])
def test_family_follows_the_scale_format(monkeypatch, scale_format, family):
    """The family checked is the one the call runs (native_format), whatever the model is."""
    assert fi_binding.native_format(scale_format).family == family
    other = "glm_nsa" if family == "dsv3_2" else "dsv3_2"
    table = flashinfer_table.table()
    monkeypatch.setattr(flashinfer_table, "table", lambda: _marked_table(table, **{family: 16, other: 128}))
    common = dict(phase="decode", topk=2048, max_tokens=1, kv_layout=layout.FP8_DS_MLA, scale_format=scale_format)
    assert fi_binding.envelope_reasons(num_heads=64, **common) == (
        f"num_heads=64 per GPU: flashinfer {family} serves 1..16",
    )
    monkeypatch.setattr(flashinfer_table, "table", lambda: _marked_table(table, **{family: 128, other: 16}))
    fi_binding.envelope_reasons.cache_clear()
    assert fi_binding.envelope_reasons(num_heads=64, **common) == ()


def test_unresolved_or_foreign_scale_formats_and_families(monkeypatch):
    common = dict(phase="decode", num_heads=64, topk=2048, max_tokens=1, kv_layout=layout.FP8_DS_MLA)
    auto = fi_binding.envelope_reasons(scale_format="auto", **common)  # select() resolves it first
    assert auto and "scale_format='auto'" in auto[0]
    assert fi_binding.envelope_reasons(scale_format="ue8m0", **common)
    table = flashinfer_table.table()
    wrong_width = {**table.decode, "glm_nsa": table.decode["dsv4"]}
    monkeypatch.setattr(flashinfer_table, "table", lambda: dataclasses.replace(table, decode=wrong_width))
    wrong = fi_binding.envelope_reasons(scale_format="arbitrary", **common)
    assert wrong and "d_qk=512" in wrong[0]
    missing = {k: v for k, v in table.decode.items() if k != "dsv3_2"}
    monkeypatch.setattr(flashinfer_table, "table", lambda: dataclasses.replace(table, decode=missing))
    fi_binding.envelope_reasons.cache_clear()
    gone = fi_binding.envelope_reasons(scale_format="pow2", **common)
    assert gone and "'dsv3_2'" in gone[0] and "glm_nsa" in gone[0]


def test_live_source_reads_the_installed_table(monkeypatch):
    """source="live" reads supported_sparse_mla_sm120_configs(), "both" unites it with the packaged table."""
    import flashinfer.mla

    real = flashinfer.mla.supported_sparse_mla_sm120_configs()
    narrowed = {**real, "glm_nsa": dataclasses.replace(real["glm_nsa"], max_num_heads=32)}
    monkeypatch.setattr(flashinfer.mla, "supported_sparse_mla_sm120_configs", lambda **_: narrowed)
    common = dict(phase="decode", num_heads=64, topk=2048, max_tokens=1, kv_layout=layout.FP8_DS_MLA)
    assert fi_binding.envelope_reasons(scale_format="arbitrary", source=fi_binding.PACKAGED, **common) == ()
    live = fi_binding.envelope_reasons(scale_format="arbitrary", source=fi_binding.LIVE, **common)
    assert live == ("num_heads=64 per GPU: flashinfer glm_nsa serves 1..32",)
    assert fi_binding.envelope_reasons(scale_format="arbitrary", source=fi_binding.BOTH, **common) == live
    assert fi_binding.envelope_reasons(scale_format="pow2", source=fi_binding.BOTH, **common) == ()


def test_both_sources_deduplicate():
    kwargs = dict(phase="prefill", num_heads=4, topk=100, max_tokens=None, kv_layout=layout.FP8_DS_MLA,
                  scale_format="pow2")
    packaged = fi_binding.envelope_reasons(source=fi_binding.PACKAGED, **kwargs)
    assert len(packaged) == 1 and "num_heads=4" in packaged[0], packaged  # a top-k of 100 is padded to 128
    assert fi_binding.envelope_reasons(source=fi_binding.BOTH, **kwargs) == packaged


# ---------------------------------------------------------------------- (d) probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU; the no-GPU reason cannot appear")
def test_probe_names_missing_gpu():
    reasons = fi_binding.probe()
    assert reasons
    assert any("no CUDA GPU" in r for r in reasons), reasons
    assert fi_binding.probe() is reasons  # cached
    fi_binding.clear_caches()
    assert fi_binding.probe() == reasons


# ------------------------------------------------------------------- (e) the call


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: tests/gpu covers the call")
def test_call_without_gpu_raises_kernel_unavailable():
    q, kv, indices, _, _ = _cpu_call_tensors()
    with pytest.raises(KernelUnavailable) as info:
        fi_binding.flashinfer_sparse_mla(
            q, kv, indices, sm_scale=0.07, kv_layout=layout.FP8_DS_MLA, scale_format="pow2"
        )
    message = str(info.value)
    # errors.format_error's three parts, whatever it puts between them
    assert re.match(r"given: .+supported: .+fix: ", message, re.S), message
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
        "import sys; import mla_sm120_plugin.dispatch.flashinfer as m; "
        "m.NATIVE_FORMATS; print(sorted(k for k in ('torch', 'flashinfer') if k in sys.modules))"
    )
    baseline = "import sys; import mla_sm120_plugin.kernels; print('torch' in sys.modules)"
    def run(source: str) -> str:
        done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, check=True, env=clean_env())
        return done.stdout.strip()

    loaded = run(code)
    package_imports_torch = run(baseline) == "True"
    expected = "['torch']" if package_imports_torch else "[]"
    assert loaded == expected
