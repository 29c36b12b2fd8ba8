"""The context builder, the engine limits, the plugin config cache and the launcher's exported
context (``context.py``), as documented.

Every test names the promise it pins (the docstrings of ``mla_sm120_plugin/context.py``): every input
lands in its field, every limit is refused in its three parts, and what the launcher wrote is what
each scheduler reads back.
"""

from __future__ import annotations

import json

import pytest
from support.cli import assert_three_parts

from mla_sm120_plugin.config import Settings
from mla_sm120_plugin.context import EngineLimits, build_context
from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS, TORCH, TRITON
from mla_sm120_plugin.errors import ConfigError
from mla_sm120_plugin.modelinfo import ModelFacts

GLM_ARCH = "GlmMoeDsaForCausalLM"


# --- the context builder and the engine limits (context.py) ---------------------------------------------


def test_build_context_carries_every_input_through():
    """context.build_context: the model facts, the settings, the device, the KV spelling and the
    engine limits each land in their field of the context."""
    from mla_sm120_plugin.config import Settings
    from mla_sm120_plugin.context import EngineLimits, build_context
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.modelinfo import ModelFacts

    facts = ModelFacts(arch=GLM_ARCH, name="my/model", num_heads=64, index_topk=1024, kv_lora_rank=512,
                       qk_rope_head_dim=64)
    settings = Settings(prefill_kernel=TORCH, decode_kernel="auto", kv_scale_format="pow2",
                        origins={"prefill_kernel": "here"})
    limits = EngineLimits(tensor_parallel_size=8, max_decode_tokens=48, max_prefill_tokens=4096, cuda_graphs=False,
                          features={"dcp"}, engine="sglang")
    ctx = build_context(facts, settings, parse_device("12.1", source="--sm"), "fp8_e4m3", limits)
    assert (ctx.model_arch, ctx.model_name, ctx.num_heads, ctx.index_topk) == (GLM_ARCH, "my/model", 8, 1024)
    assert (ctx.kv_cache_dtype, ctx.kv_cache_dtype_given, ctx.engine) == ("fp8_ds_mla", "fp8_e4m3", "sglang")
    assert (ctx.prefill_kernel, ctx.decode_kernel, ctx.kv_scale_format) == (TORCH, "auto", "pow2")
    assert (ctx.max_decode_tokens, ctx.max_prefill_tokens, ctx.cuda_graphs) == (48, 4096, False)
    assert (ctx.tensor_parallel_size, ctx.features, ctx.forced_by) == (8, frozenset({"dcp"}), "prefill_kernel from here")
    assert (ctx.device.sm, ctx.kv_lora_rank, ctx.qk_rope_head_dim) == ("12.1", 512, 64)
    # kv_scale_format auto: the engine's own writer decides (SGLang: arbitrary); vLLM leaves it to the model.
    auto = Settings()
    sglang_auto = build_context(facts, auto, parse_device("12.1", source="--sm"), None, limits)
    assert (sglang_auto.kv_scale_format, sglang_auto.kv_cache_dtype) == ("arbitrary", "fp8_ds_mla")
    vllm = EngineLimits(tensor_parallel_size=8)
    plain = build_context(facts, auto, parse_device("12.1", source="--sm"), None, vllm)
    assert (plain.kv_scale_format, plain.kv_cache_dtype, plain.kv_cache_dtype_given) == ("auto", "bf16", None)
    assert (plain.max_decode_tokens, plain.max_prefill_tokens, plain.cuda_graphs) == (None, None, True)


def test_the_context_carries_the_configured_precision():
    facts = ModelFacts(arch="GlmMoeDsaForCausalLM", name="glm", num_heads=64, index_topk=2048)
    device = parse_device("12.0", source="--sm")
    for precision in ("exact", "fast"):
        ctx = build_context(facts, Settings(precision=precision), device, "fp8_ds_mla", EngineLimits())
        assert ctx.precision == precision


@pytest.mark.parametrize("field, value", [
    ("tensor_parallel_size", 0), ("tensor_parallel_size", None), ("tensor_parallel_size", True),
    ("max_decode_tokens", 0), ("max_decode_tokens", "3"), ("max_decode_tokens", True),
    ("max_prefill_tokens", -1), ("max_prefill_tokens", 2.0),
])
def test_engine_limits_refuse_what_is_not_a_positive_int(field, value):
    """context.EngineLimits: sizes are positive ints (bool is not one); the token bounds may be None."""
    from mla_sm120_plugin.context import EngineLimits

    kwargs = {field: value}
    if field == "max_prefill_tokens":
        kwargs["max_decode_tokens"] = None  # a None before it does not end the checks
    with pytest.raises(ConfigError) as err:
        EngineLimits(**kwargs)
    msg = str(err.value)
    assert msg == (f"given: {field}={value!r}\nsupported: a positive integer\n"
                   f"fix: set {field.replace('_', '-')} to 1 or more")


def test_engine_limits_name_the_engines_and_take_the_engines_scale_format():
    """context.EngineLimits: an unknown engine is refused naming the known ones; scale_format None
    means the engine's own (SGLang: arbitrary, vLLM: the model's); features become a frozenset."""
    from mla_sm120_plugin.context import EngineLimits

    with pytest.raises(ConfigError) as err:
        EngineLimits(engine="trt")
    assert str(err.value) == ("given: engine='trt'\nsupported: one of ['vllm', 'sglang']\n"
                              "fix: pass the engine the context is built for")
    assert EngineLimits(engine="sglang").scale_format == "arbitrary"
    assert EngineLimits(engine="sglang", scale_format="pow2").scale_format == "pow2"
    assert EngineLimits().scale_format is None
    limits = EngineLimits(features=["dcp", "dcp"])
    assert limits.features == frozenset({"dcp"}) and isinstance(limits.features, frozenset)
    assert EngineLimits(max_decode_tokens=None, max_prefill_tokens=None).max_prefill_tokens is None


# --- the plugin config, read once per source ------------------------------------------------------------


def test_plugin_config_is_cached_per_inline_content():
    """context.plugin_config: "read once per process for the same sources": a different inline dict
    is another source."""
    from mla_sm120_plugin.context import plugin_config

    a = plugin_config({"decode_kernel": TRITON}, kernel_names=BUILTIN_KERNELS).for_model(None, None)
    b = plugin_config({"decode_kernel": TORCH}, kernel_names=BUILTIN_KERNELS).for_model(None, None)
    assert (a.decode_kernel, b.decode_kernel) == (TRITON, TORCH)
    assert plugin_config(None, kernel_names=BUILTIN_KERNELS).for_model(None, None).decode_kernel == "auto"


def test_the_inline_config_is_read_once_whatever_its_key_order(monkeypatch):
    from mla_sm120_plugin import config as config_mod
    from mla_sm120_plugin import context

    context.clear_config_cache()
    reads = []
    original = config_mod.load_config
    monkeypatch.setattr(config_mod, "load_config", lambda *a, **k: reads.append(1) or original(*a, **k))
    first = {"precision": "exact", "kv_scale_format": "pow2"}
    second = {"kv_scale_format": "pow2", "precision": "exact"}
    a = context.plugin_config(first, kernel_names=("triton_sparse_mla",))
    b = context.plugin_config(second, kernel_names=("triton_sparse_mla",))
    assert a is b and len(reads) == 1
    context.clear_config_cache()


def test_an_inline_value_json_cannot_hold_is_the_configs_error_not_a_crash():
    from mla_sm120_plugin import context
    from mla_sm120_plugin.errors import ConfigError

    context.clear_config_cache()
    with pytest.raises(ConfigError):
        context.plugin_config({"precision": object()}, kernel_names=("triton_sparse_mla",))
    context.clear_config_cache()


# --- the launcher's exported context --------------------------------------------------------------------


def test_the_launchers_context_reaches_the_schedulers_whole():
    """context.context_to_json / context_from_json: what SGLang's launcher decided is what each
    scheduler decides again (every field, the device and the features); other text is refused."""
    from mla_sm120_plugin.context import context_from_json, context_to_json
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    ctx = SelectionContext(GLM_ARCH, "fp8_ds_mla", 8, 1024, parse_device("12.1", source="sglang"), model_name="m",
                           features=frozenset({"dcp", "hisparse"}), max_decode_tokens=48, decode_kernel=TRITON)
    text = context_to_json(ctx)
    fields = json.loads(text)
    assert fields["features"] == ["dcp", "hisparse"] and fields["device"]["sm_major"] == 12
    assert list(fields) == sorted(fields)
    back = context_from_json(text)
    assert back == ctx and isinstance(back.features, frozenset) and back.device.sm == "12.1"
    for bad in ("not json", "{}", json.dumps({**fields, "device": {"vendor": "tpu"}}), "[]"):
        with pytest.raises(ConfigError) as err:
            context_from_json(bad)
        assert_three_parts(str(err.value), "a serialized selection context that does not parse (")
        if bad == "not json":
            assert "does not parse (JSONDecodeError: " in str(err.value)
        assert str(err.value).endswith("supported: what context_to_json wrote, from this plugin version\n"
                                       "fix: restart the engine so its launcher decides again")
