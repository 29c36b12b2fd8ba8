"""Every environment variable is named once (mla_sm120_plugin/envs.py) and README's table is that table."""

from __future__ import annotations

import re
from pathlib import Path

from mla_sm120_plugin import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mla_sm120_plugin"
_NAME = re.compile(r"MLA_SM120_[A-Z0-9_]*[A-Z0-9]")


def test_no_module_but_envs_spells_a_variable_name():
    """A variable written anywhere else would be a second source of truth for its name (and a typo
    there a silently ignored setting). Docstrings and comments may name them; code may not."""
    import ast

    spelled = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for name in _NAME.findall(node.value):
                    if name != "MLA_SM120_SPARSE":  # vLLM's backend *name*, not a variable
                        spelled.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    assert not spelled, spelled


def test_every_variable_is_named_once_and_starts_with_the_prefix():
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    assert all(name.startswith(envs.PREFIX) for name in names)
    constants = {value for key, value in vars(envs).items() if key.isupper() and key != "PREFIX"
                 and isinstance(value, str)}
    assert constants == set(names), constants ^ set(names)


def test_readme_holds_the_settings_table():
    readme = (ROOT / "README.md").read_text()
    assert envs.markdown_table() in readme
    assert "MLA_SM120_SGLANG_PLAN" not in envs.markdown_table()  # the plugin's own, not a user's
