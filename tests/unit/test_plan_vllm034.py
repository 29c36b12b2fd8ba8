"""vLLM 0.34.0 beside 0.33.0 in the plan (issue 35): the release is an input of every plan.

``mla-sm120 check`` plans for ``--engine-version``, else the installed release, else the newest
supported; an unsupported release is refused with given / supported / fix (what ``register()``
logs). What differs between the releases: V4.1's compressed pages on SM12x (128 -> 64 entries),
the rope-less fp8 row (656 -> 528 bytes) and two new sparse-MLA models, Kimi K3.1 and Mistral
Large 4, which 0.33 (and SGLang 0.5.23) do not build. Their config.json shapes are read here as
vLLM 0.34 reads them (Kimi K3.1's nested text_config and dsa_config; Mistral Large 4's per-layer
lists after vLLM's params.json remap).
"""

from __future__ import annotations

import json

import pytest
from support.cli import assert_three_parts, decision_of, run_cli

from mla_sm120_plugin import cli
from mla_sm120_plugin.engines import RELEASES, installed_release

# Kimi K3.1 as vLLM 0.34's KimiK3Config / KimiLinearConfig read it: the multimodal top level, the text
# model under text_config, its DSA settings nested in dsa_config (index_topk there only).
KIMI_K31 = {
    "architectures": ["KimiK31ForConditionalGeneration"], "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "num_attention_heads": 48, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "mla_use_nope": True, "num_hidden_layers": 8,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7]},
        "dsa_config": {"dsa_layers": [4, 8], "index_topk": 1024, "index_head_dim": 64, "index_num_heads": 16,
                       "index_rope_dim": 0, "index_topk_freq": 1},
    },
}
# Mistral Large 4 as vLLM 0.34 remaps its params.json: the indexer's keys at the top level and the
# per-layer lists (NoPE layers, shared KV, shared indexers).
MISTRAL_LARGE_4 = {
    "architectures": ["MistralLarge4ForCausalLM"], "model_type": "mistral_large_4", "num_attention_heads": 96,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": None,
    "num_hidden_layers": 4, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
    "nope_layer_flags": [False, True, False, True], "kv_source_layers": [0, 1, 0, 1],
    "index_sharing": ["full", "shared", "full", "shared"],
}
MODELS = {"kimi-k3.1": KIMI_K31, "mistral-large-4": MISTRAL_LARGE_4}


def _check(capsys, *argv: str) -> tuple[int, dict]:
    """``check --json``: its report, or for a refusal its message (the error's own text)."""
    rc = cli.main(["check", *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else {"stderr": json.loads(out.out)["message"]})


def _write(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_new_models_plan_on_sm12x_under_vllm_034(tmp_path, capsys, name):
    model_dir = _write(tmp_path, MODELS[name])
    cfg = MODELS[name].get("text_config", MODELS[name])
    topk = cfg.get("index_topk") or cfg["dsa_config"]["index_topk"]
    for model in (name, model_dir):
        for sm in ("12.0", "12.1"):
            for tp in ("1", "8"):
                rc, report = _check(capsys, "--model", model, "--sm", sm, "--tp", tp, "--engine-version", "0.34.0")
                assert rc == 0, report
                assert report["engine_release"] == "0.34.0"
                report = decision_of(report)
                assert set(report["kernels"]) == {"decode", "prefill"} and all(report["kernels"].values())
                assert report["kv_cache_dtype"] == "fp8_ds_mla"  # 512 + 64: the ordinary 656-byte row
                if model == model_dir:  # the config's own heads and top-k, not the profile's defaults
                    assert report["heads_per_rank"] == cfg["num_attention_heads"] // int(tp)
                    assert report["index_topk"] == topk


def test_kimi_k31_by_name_plans_twelve_heads_a_gpu_at_tp8(capsys):
    """Kimi K3 / K3.1 has 96 query heads (profiles.py SOURCES: the public Kimi-K3 config, vLLM 0.34's K3.1
    code), so vLLM builds 12 a GPU at TP 8; the plan's kernels are chosen for 12 (FlashInfer has no 12-head
    prefill kernel)."""
    rc, report = _check(capsys, "--model", "kimi-k3.1", "--sm", "12.0", "--tp", "8", "--engine-version", "0.34.0")
    assert rc == 0, report
    decision = decision_of(report)
    assert (decision["heads_per_rank"], decision["index_topk"], decision["kv_cache_dtype"]) == (12, 2048, "fp8_ds_mla")
    assert "flashinfer_sparse_mla" not in decision["kernels"].values()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_vllm_033_and_sglang_refuse_them_naming_vllm_034(tmp_path, capsys, name):
    model_dir = _write(tmp_path, MODELS[name])
    rc, report = _check(capsys, "--model", model_dir, "--sm", "12.0", "--engine-version", "0.33.0")
    assert rc == 2
    assert_three_parts(report["stderr"])
    arch = MODELS[name]["architectures"][0]
    assert f"given: model_arch={arch}" in report["stderr"] and "under vLLM 0.33.0" in report["stderr"]
    assert "fix: vLLM 0.34.0 is the first vLLM that builds it" in report["stderr"]
    rc, report = _check(capsys, "--model", model_dir, "--sm", "12.0", "--engine", "sglang")
    assert rc == 2 and "SGLang 0.5.23 has no such model: serve it with vLLM 0.34.0" in report["stderr"]


@pytest.mark.parametrize("key, value, words", [
    ("dsa_config", "2048", "an object of indexer settings"),
    ("dsa_config", {"index_topk": "2048"}, "dsa_config: index_topk='2048'"),
    ("mla_use_nope", "yes", "true or false"),
    ("dsa_config", {**KIMI_K31["text_config"]["dsa_config"], "dsa_layers": [4, 9]}, "a list of layer numbers from 1 to 8"),
])
def test_kimis_nested_keys_are_checked(tmp_path, capsys, key, value, words):
    cfg = {**KIMI_K31, "text_config": {**KIMI_K31["text_config"], key: value}}
    rc, report = _check(capsys, "--model", _write(tmp_path, cfg), "--sm", "12.0", "--engine-version", "0.34.0")
    assert rc == 2 and words in report["stderr"], report
    assert_three_parts(report["stderr"])


@pytest.mark.parametrize("key, value, words", [
    ("nope_layer_flags", [False, "nope", False, True], "one a layer"),
    ("nope_layer_flags", "nope,rope", "one a layer"),
    ("index_sharing", ["full", 1, "full", "shared"], '"full": the layer runs its own indexer'),
])
def test_mistrals_layer_lists_are_checked(tmp_path, capsys, key, value, words):
    cfg = {**MISTRAL_LARGE_4, key: value}
    rc, report = _check(capsys, "--model", _write(tmp_path, cfg), "--sm", "12.0", "--engine-version", "0.34.0")
    assert rc == 2 and words in report["stderr"], report
    assert_three_parts(report["stderr"])


def test_v41_compressed_pages_follow_the_release(capsys):
    """vllm#59203: V4.1's compressed kernel block is 64 on SM12x from 0.34 (128 before); entries a page =
    block / ratio."""
    pages = {}
    for release in RELEASES["vllm"]:
        rc, report = _check(capsys, "--model", "deepseek-v4.1-flash", "--sm", "12.0", "--engine-version", release)
        assert rc == 0, report
        pages[release] = {kind: body["call"]["extra_page"] for kind, body in report["layer_kinds"].items()}
    assert pages == {"0.33.0": {"window": 0, "c1a": 128, "c2a": 64}, "0.34.0": {"window": 0, "c1a": 64, "c2a": 32}}


def test_the_rope_less_fp8_row_follows_the_release(capsys):
    """vLLM 0.34 sizes a rope-less model's fp8_ds_mla rows by the impl (528, its own SM120 impl's
    answer); 0.33 keeps 656 bytes with the rope's 128 reserved."""
    layouts = {}
    for release in RELEASES["vllm"]:
        rc, report = _check(capsys, "--model", "glm-5.3-flash", "--sm", "12.0", "--kv-cache-dtype", "fp8_ds_mla",
                            "--engine-version", release)
        assert rc == 0, report
        layouts[release] = report["kv_cache"]["name"]
    assert layouts == {"0.33.0": "fp8_ds_mla_nope", "0.34.0": "fp8_nope"}


def test_the_release_planned_for_is_said_and_an_unsupported_one_refused(capsys):
    rc, report = _check(capsys, "--model", "glm-5", "--sm", "12.0")
    assert rc == 0
    installed = installed_release("vllm")
    expected = installed or list(RELEASES["vllm"])[-1]
    assert report["engine_release"] == expected
    why = "the release installed here" if installed else "none installed here: the newest the plugin supports"
    assert f"planned for vLLM {expected} ({why}; --engine-version " in " ".join(report["notes"])
    rc, report = _check(capsys, "--model", "glm-5", "--sm", "12.0", "--engine-version", "0.32.0")
    assert rc == 2
    assert_three_parts(report["stderr"])
    assert "given: vLLM 0.32.0\nsupported: vLLM 0.33.0 or 0.34.0" in report["stderr"]
    assert "fix: pass --engine-version 0.33.0 or 0.34.0; or pip install" in report["stderr"]


def test_kimi_with_dense_mla_layers_is_refused_under_the_opt_in(tmp_path, capsys):
    """An MLA layer outside dsa_config.dsa_layers is built dense by vLLM, and --attention-backend CUSTOM
    gives it the plugin's sparse-only backend, which vLLM's selector refuses at build: check says so
    first. (Layers 1-3 and 5-7 are linear, 4 and 8 sparse in KIMI_K31; dropping 8 from dsa_layers
    leaves one dense MLA layer.)"""
    text = KIMI_K31["text_config"]
    cfg = {**KIMI_K31, "text_config": {**text, "dsa_config": {**text["dsa_config"], "dsa_layers": [4]}}}
    rc, report = _check(capsys, "--model", _write(tmp_path, cfg), "--sm", "12.0", "--engine-version", "0.34.0")
    assert rc == 2, report
    assert_three_parts(report["stderr"])
    assert "has 1 dense MLA layer(s) (MLA layers outside dsa_config.dsa_layers)" in report["stderr"]
    assert "fix: serve this model without --attention-backend CUSTOM" in report["stderr"]


def test_the_capacity_compares_only_the_planned_releases_layouts(capsys):
    """The release travels in the context: GLM-5.3-Flash's 528-byte rows under 0.34 are compared with
    0.34's bf16 rows, never with the 656-byte layout only 0.33 writes for it (and the reverse)."""
    compared = {}
    for release in RELEASES["vllm"]:
        rc, report = _check(capsys, "--model", "glm-5.3-flash", "--sm", "12.0", "--tp", "4", "--engine-version",
                            release)
        assert rc == 0, report
        compared[release] = {name: v["token_bytes"] for name, v in report["capacity"]["layouts"].items()}
    assert compared == {"0.33.0": {"fp8_ds_mla_nope": 656, "bf16_nope": 1024},
                        "0.34.0": {"fp8_nope": 528, "bf16_nope": 1024}}


def test_the_dsv4_nvfp4_capacity_note_names_the_planned_release():
    for release in RELEASES["vllm"]:
        res = run_cli("check", "--model", "deepseek-v4-flash", "--sm", "12.0", "--tp", "4", "--kv-cache-dtype",
                      "nvfp4_ds_mla", "--engine-version", release)
        assert res.returncode == 0, res.stderr
        (capacity,) = [line for line in res.stdout.splitlines() if line.startswith("capacity:")]
        assert f"vLLM {release} gives every block a page of each cache" in capacity
        assert all(other not in capacity for other in RELEASES["vllm"] if other != release)
