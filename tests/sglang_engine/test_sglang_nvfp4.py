"""SGLang has no writer for vLLM's 352-byte nvfp4_ds_mla rows: the plugin refuses it there, in
SGLang's words, with what it supports and the fix (serve it with vLLM)."""

from __future__ import annotations

import pytest
from support.cli import run_cli
from support.model_configs import write_model
from sglang.srt.arg_groups import overrides
from sglang.srt.server_args import ServerArgs

from mla_sm120_plugin.errors import UnsupportedConfiguration


def _check_sglang(model: str):
    return run_cli("check", "--engine", "sglang", "--model", model, "--sm", "12.1", "--tp", "4",
                   "--kv-cache-dtype", "nvfp4_ds_mla")


def test_check_refuses_nvfp4_for_sglang_with_given_supported_fix(tmp_path):
    res = _check_sglang(write_model(tmp_path, "glm"))
    assert res.returncode == 2, res.stdout
    msg = res.stderr
    assert "kv_cache_dtype=nvfp4_ds_mla" in msg and "SGLang 0.5.23 has no nvfp4_ds_mla cache writer" in msg
    supported = msg.split("supported: ", 1)[1].splitlines()[0]
    assert "fp8_e4m3" in supported and "bf16" in supported
    fix = msg.split("fix: ", 1)[1]
    assert "--kv-cache-dtype fp8_e4m3" in fix and "--attention-backend CUSTOM --kv-cache-dtype nvfp4_ds_mla" in fix


def test_sglangs_launcher_is_refused_the_same_way(tmp_path, capability, monkeypatch):
    """Through SGLang's own resolution pass (the hook the plugin installs): the same refusal, before
    any weight loads, unless SGLang's own argument checks reject the value first."""
    capability(12, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "glm")
    try:
        sa = ServerArgs(model_path=model, skip_tokenizer_init=True, kv_cache_dtype="nvfp4_ds_mla", tp_size=4)
    except (ValueError, AssertionError) as exc:  # SGLang's own refusal of the spelling
        pytest.skip(f"SGLang rejects the value itself: {exc}")
    with pytest.raises(UnsupportedConfiguration) as err:
        overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)
    assert str(err.value) == _check_sglang(model).stderr.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n")
