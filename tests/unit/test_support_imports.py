"""The test helpers' torch-free modules import where torch cannot (tests/support/__init__.py lists them).

One fresh interpreter with ``torch`` blocked (``sys.modules["torch"] = None``: any ``import torch``
raises ImportError) imports every torch-free module of ``support``; a module that imports torch at
import, itself or through what it imports, fails here by name. The same interpreter shows the block
holds: a module that does import torch is refused.
"""

from __future__ import annotations

import subprocess
import sys

from support.cli import clean_env

TORCH_FREE = ("support", "support.cli", "support.decisions", "support.model_configs", "support.internals_sites",
              "support.engine_sources")

PROBE = """
import importlib, sys
sys.modules["torch"] = None  # every import of torch now raises ImportError
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{name}: {exc}")
try:
    importlib.import_module("support.kernel_checks")
except ImportError:
    pass
else:
    failed.append("the block did not hold: support.kernel_checks imported without torch")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_the_torch_free_helpers_import_without_torch():
    done = subprocess.run([sys.executable, "-c", PROBE, *TORCH_FREE], capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_the_package_map_names_every_module():
    """The docstring of support/__init__.py names each module of the package, and nothing else."""
    from pathlib import Path

    import support

    here = Path(support.__file__).parent
    modules = {f"support.{p.stem}" for p in here.glob("*.py") if p.stem != "__init__"}
    named = {m for m in modules if f":mod:`{m}`" in support.__doc__}
    assert named == modules, sorted(modules - named)
