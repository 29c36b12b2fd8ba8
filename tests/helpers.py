"""Helpers shared by the test modules (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``mla-sm120`` in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_SM120_")}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mla_sm120_plugin.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=300,
    )
