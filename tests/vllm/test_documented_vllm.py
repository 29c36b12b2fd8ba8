"""Documented vLLM behaviour pinned from both sides, on real vLLM config objects (CPU, no weights).

- Config precedence (config.py docstring, README "Use with vLLM" / "Plugin config"): the inline
  ``--additional-config {"mla_sm120": {...}}`` beats the TOML it names (``config_file``), which
  replaces ``MLA_SM120_CONFIG``'s file; within one source exact model name > glob > architecture >
  top level, matched against vLLM's model name (what you pass to ``vllm serve``).
- The decode-call bound (engines.VLLM.decode_bound, context.EngineLimits): ``--max-num-seqs x (1 +
  --num-speculative-tokens)``, capped by ``--max-num-batched-tokens``, from a real SpeculativeConfig.
"""

from __future__ import annotations

import pytest
from support.cli import config_with_sections
from support.model_configs import write_model
from support.vllm_engine import make_vllm_config
from vllm.config import SpeculativeConfig, VllmConfig

from mla_sm120_plugin.config import CONFIG_ENV
from mla_sm120_plugin.integration.vllm.backend import decide
from mla_sm120_plugin.integration.vllm.translate import engine_limits
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON

INLINE = "--additional-config mla_sm120"


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("models"), "glm")


def _ctx(model: str, inline: dict | None = None, **kw):
    vc = make_vllm_config(model, additional_config={"mla_sm120": inline} if inline is not None else None, **kw)
    return decide(vc, "fp8_ds_mla", 12, 0).context  # the context the backend's plan decided


def _toml(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- precedence between sources ----------------------------------------------------------------------


def test_additional_config_beats_mla_sm120_config(tmp_path, monkeypatch, glm):
    """config.py: "Strongest first: the inline dict, ... (else the one MLA_SM120_CONFIG names)"."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'prefill_kernel = "{TORCH}"\n'
                                                              f'decode_kernel = "{TORCH}"\n'))
    assert (_ctx(glm).prefill_kernel, _ctx(glm).decode_kernel) == (TORCH, TORCH)
    ctx = _ctx(glm, {"decode_kernel": TRITON})
    assert (ctx.prefill_kernel, ctx.decode_kernel) == (TORCH, TRITON)
    assert f"decode_kernel from {INLINE}" in ctx.forced_by


def test_additional_config_beats_its_config_file(tmp_path, glm):
    """README "Use with vLLM": the keys of "Plugin config", "plus "config_file": "path.toml"";
    the inline keys are the stronger source."""
    named = _toml(tmp_path, "named.toml", f'prefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\n')
    ctx = _ctx(glm, {"config_file": named, "decode_kernel": TRITON})
    assert (ctx.prefill_kernel, ctx.decode_kernel) == (TORCH, TRITON)
    assert ctx.forced_by == f"prefill_kernel from {named}, decode_kernel from {INLINE}"


def test_config_file_replaces_mla_sm120_config(tmp_path, monkeypatch, glm):
    """config.py: the file ``config_file`` names is read "else the one MLA_SM120_CONFIG names": with
    both set, the environment's file is not read at all (its keys do not fill in)."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'prefill_kernel = "{TORCH}"\n'
                                                              f'decode_kernel = "{TORCH}"\n'))
    named = _toml(tmp_path, "named.toml", f'decode_kernel = "{TRITON}"\n')
    ctx = _ctx(glm, {"config_file": named})
    assert (ctx.prefill_kernel, ctx.decode_kernel) == ("auto", TRITON)
    assert ctx.forced_by == f"decode_kernel from {named}"


def test_the_forced_kernels_reach_the_decision(tmp_path, monkeypatch, glm):
    """The winning source is what vLLM's selector decides with (validate_configuration -> decide)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the Triton probe pass on this CPU
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'decode_kernel = "{TRITON}"\n'
                                                              f'prefill_kernel = "{TRITON}"\n'))
    vc = make_vllm_config(glm, enforce_eager=True, additional_config={"mla_sm120": {"decode_kernel": TORCH}})
    d = decide(vc, "fp8_ds_mla", 12, 0)
    assert (d.prefill, d.decode) == (TRITON, TORCH)


# --- precedence within the inline source, against vLLM's model name --------------------------------


@pytest.mark.parametrize("kinds", [
    ["top", "arch"], ["top", "glob"], ["top", "exact"], ["arch", "glob"], ["arch", "exact"], ["glob", "exact"],
    ["top", "arch", "glob", "exact"],
], ids="+".join)
def test_within_additional_config_the_most_specific_section_wins(glm, kinds):
    """README: "sections are matched against vLLM's model name (what you pass to vllm serve) and the
    HF architecture", exact name > glob > architecture > top level."""
    ctx = _ctx(glm, config_with_sections(glm, kinds, TRITON, TORCH))
    assert ctx.decode_kernel == TRITON
    assert ctx.model_name == glm


def test_sections_match_the_name_vllm_serves_not_a_profile_alias(glm):
    """README: sections match "what you pass to vllm serve": a section named after the built-in
    profile (glm-5) or the HF repo id does not match a local model directory."""
    ctx = _ctx(glm, {"decode_kernel": TORCH, "models": {"glm-5": {"decode_kernel": TRITON},
                                                         "zai-org/GLM-5-FP8": {"decode_kernel": FLASHINFER}}})
    assert ctx.decode_kernel == TORCH


# --- the decode-call bound ---------------------------------------------------------------------------


def _with_speculation(model: str, method: str, k: int, **kw) -> VllmConfig:
    """A real VllmConfig carrying a real SpeculativeConfig (ngram needs no draft model; mtp drafts
    with the target model's own layers), as ``vllm serve --speculative-config`` builds it."""
    vc = make_vllm_config(model, **kw)
    extra = dict(prompt_lookup_max=3, prompt_lookup_min=1) if method == "ngram" else {}
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, target_model_config=vc.model_config,
                             target_parallel_config=vc.parallel_config, **extra)
    return VllmConfig(model_config=vc.model_config, device_config=vc.device_config, cache_config=vc.cache_config,
                      parallel_config=vc.parallel_config, scheduler_config=vc.scheduler_config,
                      speculative_config=spec)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculative_tokens_count_in_the_decode_bound(glm, method):
    """engines.VLLM.decode_bound: "--max-num-seqs x (1 + --num-speculative-tokens)": a decode step
    verifies every draft token of every sequence in one call."""
    plain = make_vllm_config(glm, max_num_seqs=8, max_num_batched_tokens=4096)
    assert engine_limits(plain).max_decode_tokens == 8
    spec = _with_speculation(glm, method, 3, max_num_seqs=8, max_num_batched_tokens=4096)
    assert spec.speculative_config.num_speculative_tokens == 3
    assert engine_limits(spec).max_decode_tokens == 8 * (1 + 3)
    assert decide(spec, "fp8_ds_mla", 12, 0).context.max_decode_tokens == 32


def test_the_decode_bound_is_capped_by_max_num_batched_tokens(glm):
    """backend.engine_limits: no call sees more tokens than a step schedules (max_num_batched_tokens)."""
    vc = _with_speculation(glm, "ngram", 3, max_num_seqs=256, max_num_batched_tokens=512)
    assert (vc.scheduler_config.max_num_seqs, vc.scheduler_config.max_num_batched_tokens) == (256, 512)
    assert engine_limits(vc).max_decode_tokens == 512  # not 256 x 4 = 1024
    vc = _with_speculation(glm, "ngram", 1, max_num_seqs=256, max_num_batched_tokens=512)
    assert engine_limits(vc).max_decode_tokens == 512  # 256 x 2 = 512: the cap itself
    vc = _with_speculation(glm, "ngram", 2, max_num_seqs=100, max_num_batched_tokens=512)
    assert engine_limits(vc).max_decode_tokens == 300  # under the cap
