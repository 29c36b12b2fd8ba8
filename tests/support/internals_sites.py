"""The engine internals an adapter's code touches, read from its source (no engine imported).

A site is a dotted name under the engine's package (``vllm.`` / ``sglang.``; ``flashinfer.`` too,
where an adapter reaches FlashInfer through the engine's call) that the code:

1. spells in a string (a hook target, a module the import hook waits for; an engine's environment
   variable, as ``"<module>: $NAME"``; a name of the plugin's own under an engine's, such as a child
   logger, as ``"<module>: child of <engine name>"``);
2. imports (``from vllm.x import Y`` -> ``vllm.x.Y``);
3. reads on a name it imported (``overrides.declare_resolution`` -> ``...overrides.declare_resolution``);

or an engine attribute the code reaches by name:

4. a module-level string constant naming a private global (``SELECT = "_select_dsv4_attn_cls"``),
   or a name given to ``getattr`` / ``setattr`` / ``hasattr`` (a literal or such a constant), or a
   key of ``vars(module)``;
5. a method it overrides and calls through ``super()`` (``super()._forward_decode``), or a method
   of a class it mixes into an engine class (``type(name, (Mixin, base), ...)``);
6. a private attribute (leading underscore, or ``__class__``) it reads or writes on an engine
   object: one the package itself never defines (no def, class or assignment target of that name
   in ``mla_sm120_plugin``); any attribute it writes on an object not its own (``swa.x = ...``), or
   a field it replaces (``dataclasses.replace(spec, dtype=...)``).

Names the plugin gives its own marks (``_mla_sm120*``) and dunders other than ``__class__`` are not
sites.

Each engine's catalogue (``integration/<engine>/internals.py``) must list exactly these.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mla_sm120_plugin"  # tests/support/ -> the checkout
_DOTTED = re.compile(r"^(vllm|sglang|flashinfer)(\.[A-Za-z_]\w*)+(:[\w.]+)?$")
_PRIVATE = re.compile(r"^_[a-z]\w*$")
# Python's own attributes the adapters reach by name (an import hook's loader, a closure's cells, a
# logger's switch): not an engine's.
_ENGINE_ENV = re.compile(r"^(VLLM|SGLANG)_[A-Z0-9_]+$")
PYTHONS = frozenset({"loader", "exec_module", "find_spec", "cell_contents", "disabled"})


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def package_names() -> set[str]:
    """Every name the package defines: functions, classes, assignment targets (names and attributes)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and "mla_sm120" in node.attr:
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                names.add(node.target.attr)  # an attribute the plugin declares on its own object
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def sites(room: Path, root: str) -> set[str]:
    """The sites of every module under ``room`` (an adapter package) for engine package ``root``."""
    ours = package_names()
    found: set[str] = set()
    for path in sorted(room.glob("*.py")):
        module = path.stem
        if module == "internals":  # the catalogue itself
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        imported: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root:
                for alias in node.names:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    found.add(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        found.add(alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if _DOTTED.match(node.value) and node.value.rsplit(".", 1)[1].startswith("mla_sm120"):  # ours, under an engine's name
                    found.add(f"{module}: child of {node.value.rsplit('.', 1)[0]}")
                elif _DOTTED.match(node.value) and node.value.split(".")[0] in (root, "flashinfer"):
                    found.add(node.value.replace(":", "."))
                elif _ENGINE_ENV.match(node.value):
                    found.add(f"{module}: ${node.value}")
            elif isinstance(node, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id in imported:
                    found.add(f"{imported[node.value.id]}.{node.attr}")
                elif isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                        and node.value.func.id == "super" and not node.attr.startswith("__"):
                    found.add(f"{module}: super().{node.attr}")
                elif (_PRIVATE.match(node.attr) or node.attr == "__class__") and node.attr not in ours \
                        and _mark(node.attr):
                    found.add(f"{module}: .{node.attr}")
        constants = {node.targets[0].id: node.value.value for node in tree.body
                     if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
        for value in constants.values():
            if _PRIVATE.match(value):
                found.add(f"{module}: {value}")
        mixins = {elt.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "type" and len(node.args) == 3 and isinstance(node.args[1], ast.Tuple)
                  for elt in node.args[1].elts[:1] if isinstance(elt, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in mixins:
                found.update(f"{module}: .{item.name}" for item in node.body
                             if isinstance(item, ast.FunctionDef) and not item.name.startswith("__") and _mark(item.name))
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
                arg = node.args[1]
                name = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""))
                if isinstance(name, str) and _mark(name):
                    found.add(f"{module}: .{name}")
            elif isinstance(func, ast.Attribute) and func.attr == "replace" \
                    and isinstance(func.value, ast.Name) and func.value.id == "dataclasses":
                found.update(f"{module}: .{kw.arg}" for kw in node.keywords if kw.arg and kw.arg not in ours)
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", None) == "vars" and isinstance(node.slice, ast.Constant):
                found.add(f"{module}: .{node.slice.value}")
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _mark(node.attr) \
                    and node.attr not in ours and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.add(f"{module}: .{node.attr}")
    return found


def _mark(name: str) -> bool:
    """Whether an attribute name can be the engine's (not the plugin's own mark, not a dunder but __class__)."""
    return "mla_sm120" not in name and name not in PYTHONS and (name == "__class__" or not name.startswith("__"))


def unresolved(items) -> list[str]:
    """What of a catalogue the installed engine lacks: each entry's name and dotted sites must
    resolve (:func:`pkgutil.resolve_name`); each attribute, private global or environment variable
    site must be spelled in the engine's sources beside it (its package two levels down, e.g.
    ``vllm/models``: V4.1's modules sit beside V4's)."""
    import importlib
    import pkgutil

    problems: list[str] = []
    sources: dict[Path, str] = {}
    for item in items:
        try:
            pkgutil.resolve_name(item.name)
        except Exception as exc:  # noqa: BLE001 - reported with the name
            problems.append(f"{item.name}: {type(exc).__name__}: {exc}")
            continue
        package = importlib.import_module(".".join(item.name.split(".")[:2]))
        top = Path(next(iter(package.__path__)) if hasattr(package, "__path__") else Path(package.__file__).parent)
        if top not in sources:
            sources[top] = "\n".join(p.read_text(errors="replace") for p in top.rglob("*.py"))
        for site in item.sites:
            if ": " not in site:
                try:
                    pkgutil.resolve_name(site)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{site} ({item.name}): {type(exc).__name__}: {exc}")
                continue
            name = site.split(": ", 1)[1]
            if name.startswith("child of "):
                try:
                    pkgutil.resolve_name(name.removeprefix("child of "))
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{site} ({item.name}): {type(exc).__name__}: {exc}")
                continue
            name = name.lstrip("$").removeprefix("super()").lstrip(".")
            if name != "__class__" and not re.search(rf"\b{re.escape(name)}\b", sources[top]):
                problems.append(f"{site} ({item.name}): {name} is not spelled under {top}")
    return problems
