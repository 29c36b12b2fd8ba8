"""DeepSeek-V4 planned per layer kind and phase, before any weight loads (docs/facts.md#deepseek-v4).

From profile names and from config.json files (transformers' own DeepseekV4Config, V4.1's nested
text_config), for vLLM and SGLang: each layer kind's call (q heads as the engine pads them, window
and compressed widths and pages), the kernel for each (layer kind, phase) or one refusal with
given / supported / fix.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.cli import run_cli

from mla_sm120_plugin import plan as plan_mod
from mla_sm120_plugin import report
from mla_sm120_plugin.config import load_config
from mla_sm120_plugin.context import EngineLimits, build_context, context_from_json, context_to_json
from mla_sm120_plugin.report import explain
from mla_sm120_plugin.dispatch.catalog import FLASHINFER_DSV4, TRITON_DSV4
from mla_sm120_plugin.errors import ConfigError, UnsupportedConfiguration
from mla_sm120_plugin.hooks.manager import get_registry
from mla_sm120_plugin.modelinfo import facts_from_hf_config, resolve_model
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import DeviceInfo

REG = get_registry()
SM120 = DeviceInfo("nvidia", 12, 0, name="planned", source="--sm")
SM121 = DeviceInfo("nvidia", 12, 1, name="planned", source="--sm")


def _plan(model, *, engine="vllm", tp=1, device=SM120, kv=None, precision=None, config=None, **kwargs):
    facts = resolve_model(model, registry=REG) if isinstance(model, str) else model
    settings = load_config({**({"precision": precision} if precision else {}), **(config or {})} or None,
                           kernel_names=REG.kernels).for_model(facts.name, facts.arch)
    limits = EngineLimits(tensor_parallel_size=tp, engine=engine,
                          max_decode_tokens=kwargs.pop("max_decode_tokens", None))
    return plan_mod.plan(facts, settings, device, kv, limits, registry=REG, **kwargs)


def _facts(cfg: dict, name="model"):
    return facts_from_hf_config(cfg, name=name, registry=REG, source="config.json")


V4_FLASH_KINDS = {"c128a", "c4a", "window"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("device", [SM120, SM121], ids=["sm120", "sm121"])
@pytest.mark.parametrize("tp, heads", [(1, 64), (2, 32), (4, 16), (8, 8)])
def test_v4_flash_is_planned_at_each_tp(engine, device, tp, heads):
    plan = _plan("deepseek-v4-flash", engine=engine, tp=tp, device=device)
    assert set(plan.decisions) == V4_FLASH_KINDS
    assert set(plan.kernels().values()) == {FLASHINFER_DSV4}
    for kind, decision in plan.decisions.items():
        call = decision.context.call
        # every count is one FlashInfer lists, so neither engine pads
        assert (call.decode_heads, call.prefill_heads) == (heads, heads)
        assert call.window == 128 and call.window_page == 64
        # the window page the engine's own call hands the kernel (SGLang: its 256-token pages), which
        # the self-check's case is built in
        assert call.pages_at_call == ({"vllm": 64, "sglang": 256}[engine], call.extra_page)
        assert decision.context.kv_cache_dtype == "fp8_dsv4" and decision.classes == {"prefill": "fast",
                                                                                        "decode": "fast"}
    c4a = plan.decisions["c4a"].context.call
    assert (c4a.extra, c4a.extra_page) == (512, 64)  # the indexer's top-k; 256-token pages of 4-token entries
    assert plan.decisions["c128a"].context.call.extra_page == 2
    assert plan.decisions["window"].context.call.extra == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_v4_pro_at_tp8(engine):
    plan = _plan("deepseek-v4-pro", engine=engine, tp=8)
    call = plan.decisions["c4a"].context.call
    assert (call.decode_heads, call.extra) == (16, 1024)
    assert set(plan.kernels().values()) == {FLASHINFER_DSV4}


def test_tp_past_the_output_groups_is_refused_with_the_largest_that_works():
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan("deepseek-v4-flash", tp=16)
    text = str(err.value)
    assert "8 output-projection groups" in text and "fix: use --tensor-parallel-size 8" in text
    with pytest.raises(UnsupportedConfiguration, match="a divisor of 64"):
        _plan("deepseek-v4-flash", tp=3)


@pytest.mark.parametrize("engine, own", [("vllm", "FLASHMLA_SPARSE_DSV4"), ("sglang", "--attention-backend dsv4")])
def test_sm90_is_refused_naming_the_engines_own_path(engine, own):
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan("deepseek-v4-flash", engine=engine, tp=4, device=DeviceInfo("nvidia", 9, 0, source="--sm"))
    text = str(err.value)
    assert text.count("given:") == 1 and "sm_90" in text and own in text
    # refused by the plan itself, before any selection, naming the model (and no cache it did not choose)
    assert text.startswith("given: model_arch=DeepseekV4ForCausalLM, device sm_90: this plugin serves SM12x only")


def test_sm90_names_an_nvfp4_cache_it_is_refused_for():
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan("deepseek-v4-flash", tp=4, device=DeviceInfo("nvidia", 9, 0, source="--sm"), kv="nvfp4_ds_mla")
    assert str(err.value).startswith("given: model_arch=DeepseekV4ForCausalLM, kv_cache_dtype=nvfp4_ds_mla, "
                                     "device sm_90")


@pytest.mark.parametrize("engine, kv, why", [("vllm", "bfloat16", "only supports fp8"),
                                             ("sglang", "bfloat16", "uint8 records only"),
                                             ("sglang", "nvfp4", "sglang#38646"),
                                             ("vllm", "fp8_e5m2", "no DeepSeek-V4 cache of that name")])
def test_a_cache_the_engine_refuses_is_refused_before_weights(engine, kv, why):
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan("deepseek-v4-flash", engine=engine, kv=kv)
    assert why in str(err.value) and "fix: pass --kv-cache-dtype" in str(err.value)


@pytest.mark.parametrize("engine, kv", [("vllm", "fp8"), ("vllm", "fp8_ds_mla"), ("vllm", None),
                                        ("sglang", "fp8_e4m3"), ("sglang", "auto")])
def test_each_engines_spellings_of_the_584_byte_record(engine, kv):
    assert set(_plan("deepseek-v4-flash", engine=engine, kv=kv).kernels().values()) == {FLASHINFER_DSV4}


def test_precision_exact_takes_the_triton_kernel_for_every_layer_kind():
    """FlashInfer's DeepSeek-V4 kernels are declared fast; the plugin's Triton kernel is exact class."""
    plan = _plan("deepseek-v4-flash", precision="exact")
    assert set(plan.kernels().values()) == {TRITON_DSV4}
    assert all(d.alternates.get(phase, ()) == () for d in plan.decisions.values() for phase in ("decode", "prefill"))


def test_a_refusal_every_layer_kind_shares_is_said_once():
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan("deepseek-v4-flash", precision="exact", config={"decode_kernel": FLASHINFER_DSV4})
    text = str(err.value)
    assert text.startswith("layer kinds c128a (23 layers), c4a (20 layers), window (1 layer):")
    assert text.count("given:") == 1 and "precision=exact" in text


def test_vllm_56837_shape_is_served():
    """V4.1 at 64 heads with top-k 1152 (vllm#56837: no decode kernel with an older FlashInfer, at
    warmup): FlashInfer 0.7.2 reads any top-k in decode, and 1152 is a multiple of its prefill tile."""
    cfg = {"architectures": ["DeepseekV41ForCausalLM"],
           "text_config": {"num_hidden_layers": 4, "num_attention_heads": 64, "index_topk": 1152,
                           "compress_ratios": [0, 1, 2, 1, 0], "o_groups": 8, "sliding_window": 128}}
    plan = _plan(_facts(cfg))
    assert plan.facts.geometry.version == "v4.1" and plan.facts.geometry.draft_layers == 1
    assert {k: d.context.call.layers for k, d in plan.decisions.items()} == {"window": 2, "c1a": 2, "c2a": 1}
    c1a = plan.decisions["c1a"].context.call
    assert (c1a.extra, c1a.extra_page, c1a.window_page, c1a.decode_heads) == (1152, 128, 32, 64)


def test_dspark_widens_vllms_decode_rows_and_wide_calls_take_the_prefill_form():
    plan = _plan("deepseek-v4-flash", speculative_tokens=7, dspark=True, max_decode_tokens=512)
    call = plan.decisions["c4a"].context.call
    assert (call.window, call.prefill_window) == (192, 128)  # cdiv(128 + 7, 64) * 64
    sglang = _plan("deepseek-v4-flash", engine="sglang", speculative_tokens=7, dspark=True)
    assert sglang.decisions["c4a"].context.call.window == 128


def test_a_window_off_flashinfers_prefill_tile_falls_back_only_where_that_form_runs():
    """A 100-slot window: FlashInfer's decode form reads it, its prefill form (prefill, and decode
    calls over 64 tokens) needs multiples of 64; the plugin's Triton kernel takes what it cannot."""
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 64,
           "index_topk": 512, "sliding_window": 100, "o_groups": 8}
    bounded = _plan(_facts(cfg), max_decode_tokens=64)
    assert set(bounded.kernels().items()) >= {(("c128a", "decode"), FLASHINFER_DSV4),
                                               (("c128a", "prefill"), TRITON_DSV4)}
    assert "window rows of 100 slots, not a multiple of 64" in explain(bounded.decisions["c128a"])
    unbounded = _plan(_facts(cfg))
    assert set(unbounded.kernels().values()) == {TRITON_DSV4}
    assert "decode calls may carry more than 64 tokens" in explain(unbounded.decisions["c128a"])
    with pytest.raises(UnsupportedConfiguration) as err:  # without the fallback: refused before weights
        _plan(_facts(cfg), config={"prefill_kernel": FLASHINFER_DSV4})
    assert "no kernel can run prefill" in str(err.value) or "window rows of 100 slots" in str(err.value)


def test_sglang_prefill_keeps_the_ranks_heads_and_flashinfer_has_no_such_prefill_kernel():
    """A 96-head model at TP2: vLLM pads q to 64 in both phases and FlashInfer serves it; SGLang pads
    decode to 64 but prefills with 48 heads, for which FlashInfer has no prefill kernel: the
    plugin's Triton kernel takes SGLang's prefill."""
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 96,
           "index_topk": 512, "o_groups": 8}
    vllm = _plan(_facts(cfg), tp=2)
    assert vllm.decisions["c128a"].context.call.prefill_heads == 64
    assert set(vllm.kernels().values()) == {FLASHINFER_DSV4}
    sglang = _plan(_facts(cfg), engine="sglang", tp=2)
    assert sglang.kernels()[("c128a", "prefill")] == TRITON_DSV4
    assert sglang.kernels()[("c128a", "decode")] == FLASHINFER_DSV4
    assert "prefill kernels exist for [8, 16, 32, 64, 128] q heads, not 48" in explain(sglang.decisions["c128a"])


def test_transformers_own_config_is_read_layer_by_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, "DeepseekV4Config", None)
    if config_cls is None:
        pytest.skip("this transformers has no DeepseekV4Config")
    cfg = config_cls(num_hidden_layers=7, architectures=["DeepseekV4ForCausalLM"])
    cfg.save_pretrained(tmp_path)
    res = run_cli("check", "--model", str(tmp_path), "--sm", "12.0", "--tp", "8", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    counts = {kind: v["call"]["layers"] for kind, v in plan["layer_kinds"].items()}
    ratio = {"sliding_attention": "window", "compressed_sparse_attention": "c4a",
             "heavily_compressed_attention": "c128a"}
    want: dict[str, int] = {}
    for t in cfg.layer_types:
        want[ratio[t]] = want.get(ratio[t], 0) + 1
    want["window"] = want.get("window", 0) + cfg.num_nextn_predict_layers  # the MTP layer(s)
    assert counts == want and plan["details"]["layers_known"] is True


@pytest.mark.parametrize("key, value, needle", [
    ("layer_types", ["sliding_attention", "dense"], "layer_types"),
    ("compress_rates", {"compressed_sparse_attention": 8}, "compress_rates"),
    ("compress_ratios", [0, 4, 3], "compress_ratios"),
    ("sliding_window", "128", "sliding_window"),
    ("o_groups", 0, "o_groups"),
    ("num_hidden_layers", 5, "2 layer types for num_hidden_layers=5"),
])
def test_a_malformed_v4_key_is_refused_naming_it(key, value, needle):
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 64,
           "layer_types": ["sliding_attention", "compressed_sparse_attention"]}
    if key == "compress_ratios":
        cfg.pop("layer_types")
    cfg[key] = value
    with pytest.raises(ConfigError) as err:
        _facts(cfg)
    assert needle in str(err.value) and "fix:" in str(err.value)


def test_v41_ratios_are_checked_and_required():
    base = {"architectures": ["DeepseekV41ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 64}
    with pytest.raises(ConfigError, match="compress_ratios"):
        _facts(base)
    with pytest.raises(ConfigError, match=r"ints from \[0, 1, 2\]"):
        _facts({**base, "compress_ratios": [0, 4, 0]})


def test_a_dsa_selection_refuses_a_dsv4_model_and_the_reverse():
    facts = resolve_model("deepseek-v4-flash", registry=REG)
    settings = load_config(None, kernel_names=REG.kernels).for_model(facts.name, facts.arch)
    ctx = build_context(facts, settings, SM120, "fp8_ds_mla", EngineLimits())
    assert ctx.family == "dsv4" and ctx.call is None  # the base context, before the family shapes it
    with pytest.raises(UnsupportedConfiguration, match="decided as a context of family 'dsv4' without a layer kind's"):
        select(ctx, registry=REG)
    # the reverse: a DSA model's context carrying a DeepSeek-V4 call
    glm = resolve_model("glm-5", registry=REG)
    dsa = build_context(glm, load_config(None, kernel_names=REG.kernels).for_model(glm.name, glm.arch), SM120,
                        "fp8_ds_mla", EngineLimits())
    call = _plan("deepseek-v4-flash").decisions["c4a"].context.call
    wrong = dataclasses.replace(dsa, call=call)
    with pytest.raises(UnsupportedConfiguration, match="decided as a context of family 'dsa' with a layer kind's"):
        select(wrong, registry=REG)


def test_a_layer_kinds_context_survives_the_json_round_trip():
    plan = _plan("deepseek-v4-flash", engine="sglang", tp=4)
    ctx = plan.decisions["c4a"].context
    assert context_from_json(context_to_json(ctx)) == ctx


def test_check_prints_a_row_per_kind_and_phase_and_the_opt_in():
    res = run_cli("check", "--model", "deepseek-v4-flash", "--sm", "12.1", "--tp", "4")
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith(("c128a", "c4a", "window"))]
    assert len(rows) == 6 and all(FLASHINFER_DSV4 in r for r in rows)
    assert "--attention-backend CUSTOM makes every DeepSeek-V4 layer the plugin's subclass" in res.stdout
    assert "the layer counts are not the model's" in res.stdout  # a profile, not a config.json
    refused = run_cli("check", "--model", "deepseek-v4-flash", "--sm", "9.0", "--tp", "4")
    assert refused.returncode == 2 and "FLASHMLA_SPARSE_DSV4" in refused.stderr


def test_the_json_says_the_record_and_its_capacity():
    data = report.to_dict(_plan("deepseek-v4-pro", tp=8))
    assert data["family"] == "dsv4" and data["kv_cache"] == {"name": "fp8_dsv4", "token_bytes": 584}
    capacity = data["layer_kinds"]["c4a"]["decision"]["capacity"]
    assert capacity == {"scope": "cache entries a GiB holds, per layer",
                        "layouts": {"fp8_dsv4": {"token_bytes": 584, "tokens_per_gib": (1 << 30) // 584}},
                        "ratio_vs": {}}  # not the DSA layouts' 656 / 1152 bytes
    assert data["details"]["compressed_bytes_per_token"] == {"c128a": 584 / 128, "c4a": 146.0}


# ----------------------------------------------------------------------- the 384-byte NVFP4 record


def test_nvfp4_is_planned_for_vllm_with_the_capacity_it_buys():
    """``check`` with vLLM's own NVFP4 spelling: every kind planned on the 384-byte record; FlashInfer's
    NVFP4 kernels only where their compiled shapes fit (window pages 64, rows of 128 or 512 slots)."""
    res = run_cli("check", "--model", "deepseek-v4-flash", "--sm", "12.0", "--tp", "4", "--kv-cache-dtype",
                  "nvfp4_ds_mla")
    assert res.returncode == 0, res.stderr
    assert "the 384-byte NVFP4 DeepSeek-V4 record" in res.stdout and "-> 1.52x" in res.stdout
    rows = {tuple(line.split()[:3:2]): line.split()[-2] for line in res.stdout.splitlines()
            if line.startswith(("c128a", "c4a", "window"))}
    # C128A's rows hold every entry of a 1M context (8192 slots): FlashInfer's NVFP4 kernels are built for 128 / 512
    assert rows == {("c128a", "prefill"): TRITON_DSV4, ("c128a", "decode"): TRITON_DSV4,
                    ("c4a", "prefill"): FLASHINFER_DSV4, ("c4a", "decode"): FLASHINFER_DSV4,
                    ("window", "prefill"): FLASHINFER_DSV4, ("window", "decode"): FLASHINFER_DSV4}
    plan = _plan("deepseek-v4-flash", tp=4, kv="nvfp4_ds_mla")
    data = report.to_dict(plan)
    assert data["kv_cache"] == {"name": "nvfp4_dsv4", "token_bytes": 384}
    assert data["capacity"]["ratio_vs"] == {"fp8_dsv4": 1.52}
    layouts = data["capacity"]["layouts"]
    assert layouts["nvfp4_dsv4"]["tokens_per_gib"] > layouts["fp8_dsv4"]["tokens_per_gib"]
    assert data["details"]["compressed_bytes_per_token"] == {"c128a": 3.0, "c4a": 96.0}


def test_nvfp4_is_refused_on_sm90_and_where_the_plugin_writes_no_such_record():
    refused = run_cli("check", "--model", "deepseek-v4-flash", "--sm", "9.0", "--tp", "4", "--kv-cache-dtype",
                      "nvfp4_ds_mla")
    assert refused.returncode == 2
    text = refused.stderr
    assert "given: model_arch=DeepseekV4ForCausalLM, kv_cache_dtype=nvfp4_ds_mla, device sm_90" in text
    assert "supported: an NVIDIA SM120/SM121 GPU" in text and "--kv-cache-dtype fp8_ds_mla" in text
    for kwargs, why in [(dict(engine="sglang"), "SGLang has no NVFP4 DeepSeek-V4 cache"),
                        (dict(speculative_tokens=3, dspark=True), "DSpark draft writes its window rows")]:
        with pytest.raises(UnsupportedConfiguration) as err:
            _plan("deepseek-v4-flash", kv="nvfp4_ds_mla", **kwargs)
        assert why in str(err.value) and "fix: pass --kv-cache-dtype" in str(err.value)
    cfg = {"architectures": ["DeepseekV41ForCausalLM"],
           "text_config": {"num_hidden_layers": 3, "num_attention_heads": 64, "compress_ratios": [0, 1, 2],
                           "o_groups": 8, "sliding_window": 128}}
    with pytest.raises(UnsupportedConfiguration) as err:
        _plan(_facts(cfg), kv="nvfp4_ds_mla")
    assert "SM100's record pair" in str(err.value)


def test_flashinfers_nvfp4_kernels_only_take_their_compiled_shapes():
    from mla_sm120_plugin.dispatch.flashinfer_dsv4 import nvfp4_reasons

    assert nvfp4_reasons(16, 128, 64, 512, 64) == []
    assert nvfp4_reasons(16, 128, 64, 0, 0) == []  # a window-only layer
    assert nvfp4_reasons(48, 192, 32, 1024, 128) == [
        "48 q heads: its NVFP4 kernels take [8, 16, 32, 64, 128]",
        "window pages of 32 entries: its NVFP4 kernels read 64",
        "window rows of 192 slots: its NVFP4 kernels are built for [128, 512]",
        "compressed rows of 1024 slots: its NVFP4 kernels are built for [128, 512]",
        "compressed pages of 128 entries: its NVFP4 kernels read [2, 32, 64]"]
