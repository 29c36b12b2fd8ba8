"""Read the values an installed engine's source names, without importing the module that names them.

The engines' model-specific kernels (vLLM's CuTe DSL and ROCm decode paths) import packages a CPU test
machine lacks, so their constants are read from the source text: a module-level ``NAME = <literal>``, a
keyword argument ``name=<literal>`` in a call, a default in a signature or class body, a number in a
sentence. Used by the engine suites' profile-source tests (``tests/vllm``, ``tests/sglang_engine``).
Pure Python: ast, importlib, re.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path


def package_file(package: str, relative: str) -> Path:
    """``relative`` inside the installed ``package`` (not imported); FileNotFoundError when absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{package} has no {relative}")
    return path


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def constant(path: Path, name: str) -> object:
    """The literal a module-level ``name = ...`` (or ``name: T = ...``) assigns."""
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{path}: no module-level {name}")


def keyword_values(paths: Path | list[Path], keyword: str, call: str | None = None) -> set[object]:
    """The literal values ``keyword=...`` takes in calls (of ``call`` only, when given) across ``paths``
    (a directory: its .py files); non-literal values are left out."""
    files = [paths] if isinstance(paths, Path) else paths
    files = [f for p in files for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    values: set[object] = set()
    for path in files:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if call is not None and func != call:
                continue
            for kw in node.keywords:
                if kw.arg == keyword:
                    try:
                        values.add(ast.literal_eval(kw.value))
                    except ValueError:
                        pass
    return values


def default(path: Path, cls: str, name: str) -> object:
    """The default ``cls`` gives ``name``: an annotated class-body default, or its ``__init__`` parameter's."""
    for node in ast.walk(_tree(path)):
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for item in node.body:
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == name
                    and item.value is not None):
                return ast.literal_eval(item.value)
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args.args[len(item.args.args) - len(item.args.defaults):] + item.args.kwonlyargs
                defaults = item.args.defaults + [d for d in item.args.kw_defaults]
                for arg, value in zip(args, defaults):
                    if arg.arg == name and value is not None:
                        return ast.literal_eval(value)
    raise LookupError(f"{path}: {cls} gives {name} no default")


def numbers(path: Path, pattern: str) -> set[int]:
    """The integers ``pattern``'s first group matches in the file's text (comments and docs included)."""
    return {int(m) for m in re.findall(pattern, path.read_text())}
