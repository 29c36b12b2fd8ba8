"""`mla-sm120 check` decides the same with the core install (pluggy only) as with everything installed.

The core install is simulated by ``python -I -S``: no site-packages, no PYTHON* variables, so torch,
triton and flashinfer cannot be imported and importlib.metadata finds no flashinfer-python. The
repository and a folder holding only pluggy (its package and metadata, linked) are put on
``sys.path`` by the bootstrap code (``-I`` ignores PYTHONPATH).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import clean_env

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "flashinfer", "triton")

GLM_TOPK_1024 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "num_attention_heads": 64,
    "index_topk": 1024,
}

# (id, check arguments after --model, expected kernels per layer kind: the same in both installs)
CASES = [
    ("glm5-sm121-tp16", ["glm-5", "--sm", "12.1", "--tp", "16"],
     {"dsa": {"prefill": "triton_sparse_mla_fast", "decode": "triton_sparse_mla_fast"}}),
    (
        "glm5-sm121-tp16-decode64",
        ["glm-5", "--sm", "12.1", "--tp", "16", "--max-decode-tokens", "64"],
        {"dsa": {"prefill": "triton_sparse_mla_fast", "decode": "flashinfer_sparse_mla"}},
    ),
    ("glm5-sm121-tp16-exact", ["glm-5", "--sm", "12.1", "--tp", "16", "--precision", "exact",
                               "--max-decode-tokens", "64"],
     {"dsa": {"prefill": "triton_sparse_mla_fast", "decode": "triton_sparse_mla_fast"}}),
    ("glm53-flash-sm120-tp8", ["glm-5.3-flash", "--sm", "12.0", "--tp", "8"],
     {"dsa": {"prefill": "flashinfer_sparse_mla", "decode": "flashinfer_sparse_mla"}}),
    ("glm53-flash-sglang-sm121-tp8", ["glm-5.3-flash", "--sm", "12.1", "--tp", "8", "--engine", "sglang",
                                      "--kv-cache-dtype", "fp8_e4m3"],
     {"dsa": {"prefill": "flashinfer_sparse_mla", "decode": "flashinfer_sparse_mla"}}),
    ("glm5-sm120-tp32", ["glm-5", "--sm", "12.0", "--tp", "32"], None),
    ("dsv32-sm120-tp32", ["deepseek-v3.2", "--sm", "12.0", "--tp", "32"], None),
    ("glm-dir-topk1024-tp16", ["{model_dir}", "--sm", "12.0", "--tp", "16"], None),
    # DeepSeek-V4: one decision per layer kind
    ("dsv4-flash-sm120-tp4", ["deepseek-v4-flash", "--sm", "12.0", "--tp", "4"],
     {kind: {"prefill": "flashinfer_dsv4_sm120", "decode": "flashinfer_dsv4_sm120"}
      for kind in ("c128a", "c4a", "window")}),
    ("dsv4-pro-sglang-sm121-tp8", ["deepseek-v4-pro", "--sm", "12.1", "--tp", "8", "--engine", "sglang"],
     {kind: {"prefill": "flashinfer_dsv4_sm120", "decode": "flashinfer_dsv4_sm120"}
      for kind in ("c128a", "c4a", "window")}),
    ("dsv4-flash-sm90", ["deepseek-v4-flash", "--sm", "9.0", "--tp", "4"], None),
]


def _env() -> dict[str, str]:
    """A clean environment (a stray MLA_SM120_CONFIG would decide)."""
    return clean_env()


@pytest.fixture(scope="module")
def pluggy_only(tmp_path_factory) -> Path:
    """A folder with pluggy and its metadata, nothing else."""
    import pluggy

    folder = tmp_path_factory.mktemp("core-site")
    package = Path(pluggy.__file__).parent
    (folder / package.name).symlink_to(package, target_is_directory=True)
    for dist_info in package.parent.glob("pluggy-*.dist-info"):
        (folder / dist_info.name).symlink_to(dist_info, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("glm-topk1024")
    (folder / "config.json").write_text(json.dumps(GLM_TOPK_1024))
    return folder


def _core_python(pluggy_dir: Path, code: str) -> subprocess.CompletedProcess:
    bootstrap = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(pluggy_dir)!r}]\n{code}"
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", bootstrap], cwd=ROOT, env=_env(), capture_output=True, text=True
    )


def test_core_python_sees_only_the_repo_and_pluggy(pluggy_only):
    code = (
        "import importlib.metadata as md, importlib.util as iu\n"
        "import pluggy, mla_sm120_plugin\n"
        "for name in ('torch', 'flashinfer', 'triton', 'vllm'):\n"
        "    assert iu.find_spec(name) is None, name\n"
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('torch imported')\n"
        "try:\n"
        "    md.version('flashinfer-python')\n"
        "except md.PackageNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('flashinfer-python metadata found')\n"
        "print(md.version('pluggy'))\n"
    )
    done = _core_python(pluggy_only, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def _check_args(args: list[str], model_dir: Path) -> list[str]:
    return ["check", "--model", *[a.format(model_dir=model_dir) for a in args], "--json"]


def _summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode in (0, 2), done.stderr
    data = json.loads(done.stdout)
    kinds = data.get("layer_kinds", {})  # a refusal: the error alone
    return {
        "exit": done.returncode,
        "servable": data.get("servable"),
        "kernels": {kind: v["kernels"] for kind, v in kinds.items()},
        "rejected": sorted({(kind, r["kernel"], r["phase"]) for kind, v in kinds.items()
                            for r in v["decision"]["rejected"]}),
    }


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_core_install_decides_like_the_full_install(pluggy_only, model_dir, args, expected):
    argv = _check_args(args, model_dir)
    core = _core_python(pluggy_only, f"from mla_sm120_plugin import cli\nsys.exit(cli.main({argv!r}))")
    full = subprocess.run(
        [sys.executable, "-m", "mla_sm120_plugin.cli", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    core_summary, full_summary = _summary(core), _summary(full)
    assert core_summary == full_summary
    if expected is not None:
        assert core_summary["kernels"] == expected
    if core.returncode == 0:
        # The core install says which facts it decided with; the full install has its own table.
        core_notes = json.loads(core.stdout)["notes"]
        assert any("packaged table" in n and "flashinfer not installed here" in n for n in core_notes), core_notes
        assert not any("packaged table" in n for n in json.loads(full.stdout)["notes"])


def test_planned_check_imports_no_heavy_package():
    """A check for a planned device reads packaged data only: no torch, flashinfer or triton."""
    argv = ["check", "--model", "glm-5", "--sm", "12.1", "--tp", "16", "--json"]
    code = (
        "import contextlib, io, sys\n"
        "from mla_sm120_plugin import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    cli.main({argv!r})\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"check --sm 12.1 imported {done.stdout.strip()}"
