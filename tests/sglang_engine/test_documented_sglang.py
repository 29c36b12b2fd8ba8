"""Documented SGLang behaviour pinned from both sides, with SGLang 0.5.23's own objects on the CPU.

- Config precedence (README "Use with SGLang", "Plugin config"; translate.inputs_from_sglang):
  ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` and ``--mla-sm120-config`` (exported as
  ``MLA_SM120_SGLANG_CONFIG``) form the inline source, stronger than the TOML file
  (``config_file`` in the JSON, else ``MLA_SM120_CONFIG``); within it exact model name > glob >
  architecture > top level, matched against SGLang's served model name.
- The decode-call bound (engines.SGLANG.decode_bound): ``--max-running-requests x
  --speculative-num-draft-tokens``, from a real ServerArgs through SGLang's ResolvedView.
- Phase routing: which plugin kernel (decode or prefill) each ``ForwardMode`` reaches, against the
  impl SGLang's own ``DeepseekSparseAttnBackend`` picks for it (``dsa_decode_impl`` or
  ``dsa_prefill_impl``).
"""

from __future__ import annotations

import argparse
import json
import os
import types

import pytest
import torch
from support.cli import config_with_sections
from support.model_configs import write_model
from sglang.srt.arg_groups import overrides, speculative_hook
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

from mla_sm120_plugin.config import CONFIG_ENV
from mla_sm120_plugin.context import build_context, context_from_json
from mla_sm120_plugin.integration import sglang as plugin
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON
from mla_sm120_plugin.types import DECODE, PREFILL

INLINE = f"{names.FLAG}-config / --dsa-*-backend"


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("models"), "glm")


def _view(model: str, **kw):
    sa = ServerArgs(model_path=model, skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3", **kw)
    return sa, overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))


def _ctx(model: str, **kw):
    """The context the launcher's hook builds for these ServerArgs on an SM120 GPU, undecided (the plan's
    inputs as :func:`translate.inputs_from_sglang` reads them; a forced kernel that cannot run here is
    the selection's business, not the precedence's)."""
    _, view = _view(model, **kw)
    got = translate.inputs_from_sglang(view, overrides.model_config_of(view).hf_config, (12, 0))
    return build_context(got.facts, got.settings, got.device, got.kv_cache_dtype, got.limits)


def _toml(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- precedence between sources ----------------------------------------------------------------------


def test_mla_sm120_config_beats_mla_sm120_config_env_file(tmp_path, monkeypatch, glm):
    """README "Use with SGLang": ``--mla-sm120-config '{...}'`` (the inline source) beats the TOML
    named by ``MLA_SM120_CONFIG``; keys it does not set come from the file."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'prefill_kernel = "{TORCH}"\ndecode_kernel = "{TORCH}"\n'))
    assert (_ctx(glm).prefill_kernel, _ctx(glm).decode_kernel) == (TORCH, TORCH)
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps({"decode_kernel": TRITON}))
    ctx = _ctx(glm)
    assert (ctx.prefill_kernel, ctx.decode_kernel) == (TORCH, TRITON)
    assert f"decode_kernel from {INLINE}" in ctx.forced_by


def test_dsa_backend_flags_beat_the_json_top_level_and_the_file(tmp_path, monkeypatch, glm):
    """README: "--dsa-prefill-backend / --dsa-decode-backend name a kernel per phase": they beat the
    same key at the top level of ``--mla-sm120-config`` and in the TOML file."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'prefill_kernel = "{TORCH}"\n'))
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps({"decode_kernel": TORCH}))
    ctx = _ctx(glm, dsa_prefill_backend=TRITON, dsa_decode_backend=FLASHINFER)
    assert (ctx.prefill_kernel, ctx.decode_kernel) == (TRITON, FLASHINFER)
    assert ctx.forced_by == f"prefill_kernel from {INLINE}, decode_kernel from {INLINE}"


def test_config_file_in_the_json_replaces_mla_sm120_config(tmp_path, monkeypatch, glm):
    """config.py: the file the inline config names (``config_file``) is read, "else the one
    MLA_SM120_CONFIG names": the environment's file does not fill in keys."""
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'prefill_kernel = "{TORCH}"\n'))
    named = _toml(tmp_path, "named.toml", f'decode_kernel = "{TRITON}"\n')
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps({"config_file": named}))
    ctx = _ctx(glm)
    assert (ctx.prefill_kernel, ctx.decode_kernel) == ("auto", TRITON)
    assert ctx.forced_by == f"decode_kernel from {named}"
    # The JSON's own keys, and the --dsa-*-backend flags, beat the file the JSON names.
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps({"config_file": named, "decode_kernel": TORCH}))
    assert _ctx(glm).decode_kernel == TORCH
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps({"config_file": named}))
    assert _ctx(glm, dsa_decode_backend=FLASHINFER).decode_kernel == FLASHINFER


def test_flags_through_sglangs_own_parser_reach_the_decision(tmp_path, capability, monkeypatch, glm):
    """The flags as a user types them, parsed by SGLang's parser (ServerArgs.add_cli_args with the
    plugin's flags), then resolved by the launcher's hooked pass: the winner is decided with."""
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, "{}")  # restored after the test; the flag overwrites it
    monkeypatch.setenv(CONFIG_ENV, _toml(tmp_path, "env.toml", f'decode_kernel = "{TRITON}"\n'))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    # (SGLang's parser takes triton_sparse_mla for --dsa-prefill-backend only: its decode choices lack it.)
    args = parser.parse_args(["--model-path", glm, "--skip-tokenizer-init", "--kv-cache-dtype", "bfloat16",
                              "--disable-cuda-graph", names.CONFIG_FLAG,
                              json.dumps({"prefill_kernel": TORCH, "decode_kernel": TORCH}),
                              "--dsa-prefill-backend", TRITON])
    sa = ServerArgs.from_cli_args(args)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert (ctx.prefill_kernel, ctx.decode_kernel) == (TRITON, TORCH)


# --- precedence within --mla-sm120-config, against SGLang's model name --------------------------------


@pytest.mark.parametrize("kinds", [
    ["top", "arch"], ["top", "glob"], ["top", "exact"], ["arch", "glob"], ["arch", "exact"], ["glob", "exact"],
], ids="+".join)
def test_within_mla_sm120_config_the_most_specific_section_wins(monkeypatch, glm, kinds):
    """README "Plugin config": exact model name, then glob, then architecture, then the top level."""
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps(config_with_sections(glm, kinds, TRITON, TORCH)))
    assert _ctx(glm).decode_kernel == TRITON


def test_sections_match_the_served_model_name(monkeypatch, glm):
    """translate.inputs_from_sglang: the model's name is ``--served-model-name`` when given, else
    ``--model-path``; sections are matched against it."""
    config = {"models": {"my-glm": {"decode_kernel": TRITON}, glm: {"decode_kernel": TORCH}}}
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, json.dumps(config))
    assert _ctx(glm, served_model_name="my-glm").decode_kernel == TRITON
    assert _ctx(glm).decode_kernel == TORCH


# --- the decode-call bound -----------------------------------------------------------------------------


def test_draft_tokens_count_in_the_decode_bound(glm):
    """engines.SGLANG.decode_bound: "--max-running-requests x --speculative-num-draft-tokens" (one
    target-verify call sees every draft token of every running request)."""
    sa, view = _view(glm, max_running_requests=16, speculative_algorithm="EAGLE", speculative_num_steps=3,
                     speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    hf = overrides.model_config_of(view).hf_config
    assert translate.engine_limits(view, hf).max_decode_tokens == 16 * 4
    # SGLang's own speculative pass keeps these numbers (top-k 1: draft tokens = steps + 1 = 4).
    speculative_hook._handle_eagle_family(sa)
    final = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    assert (final.max_running_requests, final.speculative_num_draft_tokens) == (16, 4)
    _, view = _view(glm, max_running_requests=16, speculative_algorithm="EAGLE", speculative_num_steps=3,
                    speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    assert translate.engine_limits(view, hf).max_decode_tokens == 16 * 8
    # Without speculation one token a request; without --max-running-requests, unbounded.
    _, view = _view(glm, max_running_requests=16)
    assert translate.engine_limits(view, hf).max_decode_tokens == 16
    _, view = _view(glm)
    assert translate.engine_limits(view, hf).max_decode_tokens is None


@pytest.mark.parametrize("spec", [
    dict(speculative_algorithm="EAGLE"),  # steps, top-k and draft tokens chosen by SGLang
    dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
         speculative_num_draft_tokens=2),  # SGLang raises draft tokens to steps + 1 = 4
], ids=["auto-chosen", "raised-to-steps+1"])
def test_the_decode_bound_covers_the_draft_tokens_sglang_resolves(glm, capability, monkeypatch, spec):
    """docs/architecture.md "SGLang: how the plugin serves it": the launcher decides from
    "--max-running-requests x draft tokens": the draft tokens SGLang will run with, as its own
    speculative pass resolves them."""
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sa, _ = _view(glm, max_running_requests=16, **spec)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)  # the launcher's decision
    decided = translate.imported("plan", "a test")[dsa.KIND].max_decode_tokens
    speculative_hook._handle_eagle_family(sa)  # SGLang's own pass, later in the same pipeline
    final = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    assert decided >= final.max_running_requests * final.speculative_num_draft_tokens


def test_resolving_the_draft_tokens_leaves_the_users_record_the_environment_and_the_log_alone(glm, caplog):
    """translate._speculative_decode_bound runs SGLang's speculative pass on a copy: the record keeps its
    declarations (SGLang's own pass still runs on it), the environment is unchanged and SGLang's
    warnings ("Max running requests is reset to 48") are not logged twice."""
    sa, view = _view(glm, speculative_algorithm="EAGLE")
    stash, env = list(getattr(sa, "_resolved_overrides", None) or ()), dict(os.environ)
    with caplog.at_level("DEBUG"):
        limits = translate.engine_limits(view, overrides.model_config_of(view).hf_config)
    assert limits.max_decode_tokens == 48 * 4  # SGLang's defaults: 48 running requests, (3, 1, 4)
    assert list(getattr(sa, "_resolved_overrides", None) or ()) == stash and dict(os.environ) == env
    assert not [r for r in caplog.records if r.name.startswith("sglang")]
    assert sa.speculative_num_draft_tokens is None and sa.max_running_requests is None


@pytest.mark.parametrize("algorithm", ["DFLASH", "MY_SPEC"])
def test_a_speculative_algorithm_the_plugin_does_not_know_leaves_the_decode_calls_unbounded(glm, algorithm):
    """translate._RESOLVED_FAMILIES: the draft tokens of an algorithm outside SGLang's EAGLE / NGRAM
    families (one SGLang has, or a name only a plugin could register) are not known before SGLang
    runs: no bound (None), so token-bounded kernels refuse with a reason instead of overrunning."""
    _, view = _view(glm, max_running_requests=16, speculative_algorithm=algorithm, speculative_num_draft_tokens=4)
    assert translate.engine_limits(view, overrides.model_config_of(view).hf_config).max_decode_tokens is None


# --- phase routing, every ForwardMode -------------------------------------------------------------------


class _Reached(Exception):
    """Raised where SGLang's forward_* has chosen its DSA impl: nothing past it runs."""


def _backend(seen: list) -> DeepseekSparseAttnBackend:
    """SGLang's DSA backend class without its GPU constructor: the two impl names it routes by, and
    its first call after choosing one, which records the choice and the plugin's phase."""
    backend = object.__new__(DeepseekSparseAttnBackend)
    backend.dsa_decode_impl, backend.dsa_prefill_impl = "sglang-decode-impl", "sglang-prefill-impl"
    backend.forward_metadata = None

    def resolve_kpool_tail_backend(topk_indices, impl):
        seen.append((impl, dsa._phase.get()))
        raise _Reached

    backend._resolve_kpool_tail_backend = resolve_kpool_tail_backend
    return backend


SGLANG_IMPL_TO_PHASE = {"sglang-decode-impl": DECODE, "sglang-prefill-impl": PREFILL}


@pytest.mark.parametrize("mode", list(ForwardMode), ids=lambda m: m.name)
def test_each_forward_mode_gets_the_kernel_of_the_impl_sglang_picks(mode):
    """docs/architecture.md "SGLang: how the plugin serves it": "decode, target-verify and draft-extend
    with the decode kernel, prefill with the prefill kernel": through SGLang's own dispatch
    (AttentionBackend.forward) and the hooked forward_decode / forward_extend, every ForwardMode of
    SGLang 0.5.23 gets the plugin phase whose kernel serves the impl SGLang itself chose
    (dsa_decode_impl -> decode kernel, dsa_prefill_impl -> prefill kernel); IDLE reaches no kernel."""
    seen: list = []
    layer = types.SimpleNamespace(is_cross_attention=False, tp_q_head_num=4, v_head_dim=512)
    batch = types.SimpleNamespace(forward_mode=mode)
    q = torch.zeros(3, 4 * 576)
    try:
        result = _backend(seen).forward(q, None, None, layer, batch)
    except _Reached:
        (sglang_impl, plugin_phase), = seen
        assert plugin_phase == SGLANG_IMPL_TO_PHASE[sglang_impl], (mode.name, sglang_impl, plugin_phase)
        expected = DECODE if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2) \
            else PREFILL
        assert plugin_phase == expected
    else:
        assert mode == ForwardMode.IDLE and seen == [] and result.shape == (3, 4 * 512)
    assert dsa._phase.get() is None  # the phase does not leak past the call


@pytest.mark.parametrize("mode, phase", [(ForwardMode.TARGET_VERIFY, DECODE), (ForwardMode.EXTEND, PREFILL)])
def test_forward_extend_reads_a_keyword_forward_batch(mode, phase):
    """The hooked forward_extend reads the batch's mode whether SGLang passes it by position or by name."""
    seen: list = []
    layer = types.SimpleNamespace(is_cross_attention=False, tp_q_head_num=4, v_head_dim=512)
    with pytest.raises(_Reached):
        _backend(seen).forward_extend(torch.zeros(3, 4 * 576), None, None, layer,
                                      forward_batch=types.SimpleNamespace(forward_mode=mode))
    assert seen[0][1] == phase
