"""validate_configuration against real vLLM configs, on the CPU with DeviceCapability(12, x)."""

from __future__ import annotations

import pytest
from support.model_configs import write_model
from support.vllm_engine import make_vllm_config, selector_kwargs
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from mla_sm120_plugin.config import CONFIG_ENV
from mla_sm120_plugin.errors import ConfigError, UnsupportedConfiguration
from mla_sm120_plugin.integration.vllm.backend import MlaSm120Backend, decide
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON, TRITON_FAST
from mla_sm120_plugin.report import decision_line


def _validate(vc, kv="fp8_ds_mla", cap=(12, 0)):
    with set_current_vllm_config(vc):
        return MlaSm120Backend.validate_configuration(**selector_kwargs(kv, cap))


def _in_tree(vc, kv="fp8_ds_mla", cap=(12, 0)):
    backend = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120.get_class()
    with set_current_vllm_config(vc):
        return backend.validate_configuration(**selector_kwargs(kv, cap))


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_accepts_fp8_ds_mla_on_sm12x(tmp_path, kind, cap):
    vc = make_vllm_config(write_model(tmp_path, kind))
    assert _validate(vc, cap=cap) == []


@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_refuses_other_families_with_our_message(tmp_path, cap):
    vc = make_vllm_config(write_model(tmp_path, "glm"))
    with pytest.raises(UnsupportedConfiguration) as err:
        _validate(vc, cap=cap)
    msg = str(err.value)
    for part in ("model_arch=GlmMoeDsaForCausalLM", f"sm={cap[0]}.{cap[1]}", "kv_cache_dtype=fp8_ds_mla",
                 "prefill_impl=auto", "decode_impl=auto", f"device sm_{cap[0]}{cap[1]}: this plugin serves SM12x only",
                 "supported: an NVIDIA SM120/SM121 GPU", "fix: ", "FLASHMLA_SPARSE"):
        assert part in msg


def test_refuses_a_non_dsa_model(tmp_path):
    vc = make_vllm_config(write_model(tmp_path, "llama"), cache_dtype="auto")
    with pytest.raises(UnsupportedConfiguration, match="LlamaForCausalLM is not a sparse-MLA model this plugin serves"):
        _validate(vc, kv="auto")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3"])
def test_plain_fp8_is_refused_naming_the_flag(tmp_path, kv):
    vc = make_vllm_config(write_model(tmp_path, "glm"), cache_dtype=kv)
    with pytest.raises(UnsupportedConfiguration, match="pass --kv-cache-dtype fp8_ds_mla"):
        _validate(vc, kv=kv)


def test_serves_what_the_in_tree_sm120_backend_refuses(tmp_path):
    # index_topk 1024: in-tree refuses (measured with its own validate_configuration); we accept.
    vc = make_vllm_config(write_model(tmp_path, "glm", index_topk=1024))
    assert any("index_topk=2048" in r for r in _in_tree(vc))
    assert _validate(vc) == []
    # bf16 KV (GLM keeps "bfloat16"): in-tree refuses, we accept and pick a bf16-reading kernel.
    vc = make_vllm_config(write_model(tmp_path, "glm"), cache_dtype="bfloat16")
    assert "kv_cache_dtype not supported" in _in_tree(vc, kv="bfloat16")
    assert _validate(vc, kv="bfloat16") == []
    d = decide(vc, "bfloat16", 12, 0)
    assert d.context.kv_cache_dtype == "bf16" and FLASHINFER not in d.kernels.values()
    # 4 heads per rank (GLM-5 at TP16).
    vc = make_vllm_config(write_model(tmp_path, "glm"), tp=16)
    assert _validate(vc) == []
    assert decide(vc, "fp8_ds_mla", 12, 1).context.num_heads == 4


def test_decision_reads_model_heads_topk_and_scale_format(tmp_path):
    vc = make_vllm_config(write_model(tmp_path, "dsv32", index_topk=512), tp=8)
    d = decide(vc, "fp8_ds_mla", 12, 0)
    ctx = d.context
    assert (ctx.model_arch, ctx.num_heads, ctx.index_topk) == ("DeepseekV32ForCausalLM", 16, 512)
    assert d.scale_format == "pow2"
    from support.kernel_checks import flashinfer_refusal_here

    refusal = flashinfer_refusal_here()  # the probe runs for a device vLLM reports: this machine's
    if refusal is not None:
        assert refusal in " ".join(r for rej in d.rejections if rej.kernel == FLASHINFER for r in rej.reasons)


def test_additional_config_override_changes_the_decision(tmp_path):
    model = write_model(tmp_path, "glm")
    auto = decide(make_vllm_config(model, enforce_eager=True), "fp8_ds_mla", 12, 0)
    forced = decide(
        make_vllm_config(model, enforce_eager=True,
                         additional_config={"mla_sm120": {"decode_kernel": TORCH, "kv_scale_format": "pow2"}}),
        "fp8_ds_mla", 12, 0,
    )
    assert forced.decode == TORCH and forced.scale_format == "pow2"
    assert auto.scale_format == "arbitrary"
    # Forcing a kernel that cannot run here fails with our message, naming the source.
    vc = make_vllm_config(model, additional_config={"mla_sm120": {"decode_kernel": "flashmla_sparse"}})
    with pytest.raises(UnsupportedConfiguration, match="decode_kernel from --additional-config mla_sm120"):
        _validate(vc)


def test_config_file_override_matches_the_model_name(tmp_path, monkeypatch):
    model = write_model(tmp_path, "glm")
    other = write_model(tmp_path, "dsv32")
    cfg = tmp_path / "mla.toml"
    cfg.write_text(f'[models."{model}"]\nprefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\n')
    monkeypatch.setenv(CONFIG_ENV, str(cfg))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the Triton probe pass on this CPU
    d = decide(make_vllm_config(model, enforce_eager=True), "fp8_ds_mla", 12, 0)
    assert d.prefill == d.decode == TORCH
    # The section for one model does not leak into the next.
    d2 = decide(make_vllm_config(other, enforce_eager=True), "fp8_ds_mla", 12, 0)
    assert d2.decode == TRITON_FAST
    # Named inline through config_file, a file with a bad key fails naming file and key.
    bad = tmp_path / "bad.toml"
    bad.write_text('decode_kernal = "auto"\n')
    vc = make_vllm_config(model, additional_config={"mla_sm120": {"config_file": str(bad)}})
    with pytest.raises(ConfigError, match="decode_kernal"):
        _validate(vc)


def test_hisparse_is_refused_before_weights_load(tmp_path):
    from vllm.config.attention import HiSparseConfig

    vc = make_vllm_config(write_model(tmp_path, "glm"))
    vc.attention_config.hisparse_config = HiSparseConfig()
    with pytest.raises(UnsupportedConfiguration, match="hisparse is on: HiSparse writes the cache"):
        _validate(vc)


def _lines_after_combination(message: str) -> list[str]:
    """The reason, supported and fix lines: everything but the combination (which names the model
    as each caller calls it)."""
    return message.splitlines()[1:]


@pytest.mark.parametrize("sm", ["9.0", "10.0"])
def test_vllm_refuses_other_families_with_the_text_check_prints(tmp_path, sm):
    from support.cli import run_cli

    model = write_model(tmp_path, "glm")
    major, minor = (int(x) for x in sm.split("."))
    with pytest.raises(UnsupportedConfiguration) as err:
        _validate(make_vllm_config(model), cap=(major, minor))
    res = run_cli("check", "--model", model, "--sm", sm, "--kv-cache-dtype", "fp8_ds_mla")
    assert res.returncode == 2
    cli_message = res.stderr.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n")
    assert _lines_after_combination(cli_message) == _lines_after_combination(str(err.value))
    assert f"device sm_{major}{minor}: this plugin serves SM12x only" in cli_message


def test_check_and_vllm_build_the_same_context(tmp_path):
    # The same deployment through both translators: vLLM's config objects and check's flags, each planned.
    from mla_sm120_plugin.context import EngineLimits, plugin_config
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.engines import installed_release
    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.integration.vllm.translate import plan_from_vllm
    from mla_sm120_plugin.modelinfo import resolve_model
    from mla_sm120_plugin.plan import plan

    model = write_model(tmp_path, "glm", index_topk=1024)
    vc = make_vllm_config(model, tp=16, max_num_seqs=32, enforce_eager=True,
                          additional_config={"mla_sm120": {"decode_kernel": TRITON}})
    from_vllm = plan_from_vllm(vc, "fp8_ds_mla", (12, 1)).decision.context
    reg = get_registry()
    facts = resolve_model(model, registry=reg)
    settings = plugin_config({"decode_kernel": TRITON}, kernel_names=reg.kernels).for_model(facts.name, facts.arch)
    from_cli = plan(facts, settings, parse_device("12.1", source="--sm"), "fp8_ds_mla",
                    EngineLimits(tensor_parallel_size=16, max_decode_tokens=32, max_prefill_tokens=4096,
                                 cuda_graphs=False, release=installed_release("vllm"))).decision.context
    differ = {f for f in from_cli.__dataclass_fields__ if getattr(from_cli, f) != getattr(from_vllm, f)}
    # Only where the device came from and where the forced kernel came from may differ.
    assert differ <= {"device", "forced_by"}, differ
    assert (from_vllm.device.sm, from_cli.device.sm) == ("12.1", "12.1")
    assert (from_vllm.num_heads, from_vllm.index_topk, from_vllm.tensor_parallel_size) == (4, 1024, 16)
    assert from_vllm.release == installed_release("vllm")


def test_config_is_read_once_per_process(tmp_path, monkeypatch):
    from mla_sm120_plugin import context

    model = write_model(tmp_path, "glm")
    cfg = tmp_path / "mla.toml"
    cfg.write_text(f'decode_kernel = "{TRITON}"\n')
    monkeypatch.setenv(CONFIG_ENV, str(cfg))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reads = []
    original = context.config_mod.load_config
    monkeypatch.setattr(context.config_mod, "load_config", lambda *a, **k: reads.append(1) or original(*a, **k))
    for _ in range(3):
        assert decide(make_vllm_config(model, enforce_eager=True), "fp8_ds_mla", 12, 0).decode == TRITON
    assert len(reads) == 1


@pytest.mark.parametrize("change, needle", [
    (dict(kv_lora_rank=256), "model geometry kv_lora_rank=256"),
    (dict(qk_rope_head_dim=0), "config.json has qk_rope_head_dim=0, but its architecture GlmMoeDsaForCausalLM"),
])
def test_the_models_own_geometry_is_checked_before_weights_load(tmp_path, change, needle):
    """vLLM's hf_text_config is read, not the profile: a GLM-5 config with another latent or rope width
    is refused with check's lines."""
    from support.cli import run_cli

    model = write_model(tmp_path, "glm", **change)
    with pytest.raises(UnsupportedConfiguration) as err:
        _validate(make_vllm_config(model))
    assert needle in str(err.value)
    res = run_cli("check", "--model", model, "--sm", "12.0")
    assert res.returncode == 2 and needle in res.stderr
    assert _lines_after_combination(res.stderr.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n")) == \
        _lines_after_combination(str(err.value))


def test_the_decision_line_names_the_precision_and_the_config_switches_it(tmp_path):
    model = write_model(tmp_path, "glm")
    fast = decide(make_vllm_config(model, tp=16), "fp8_ds_mla", 12, 0)
    exact = decide(make_vllm_config(model, tp=16, additional_config={"mla_sm120": {"precision": "exact"}}),
                   "fp8_ds_mla", 12, 0)
    assert "precision=fast" in decision_line(fast) and "precision=exact" in decision_line(exact)
    # exact keeps to exact-class kernels: FlashInfer's single-e4m3 path out, the fp8-MMA Triton kernel in
    assert FLASHINFER not in exact.kernels.values() and set(exact.classes.values()) == {"exact"}
    assert "(accuracy class: prefill exact, decode exact)" in decision_line(exact)
