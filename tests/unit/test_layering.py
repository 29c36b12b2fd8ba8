"""The package's layers point one way: the pure kernels know nothing of the plugin around them.

``mla_sm120_plugin/kernels/`` holds kernels and the bytes they read. A module there may import
other kernel modules and :mod:`mla_sm120_plugin.errors` (a leaf: exception types and the message
shape), nothing else of the package: not the decision layer (hooks, selection, config, context,
engines, modelinfo, device, types, cli, integration) and not the layer above it that registers,
binds, proves and benchmarks kernels (dispatch, tools). Nor does it hold a hook implementation.
Read from the source (``ast``), so an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mla_sm120_plugin"
KERNELS = PACKAGE / "kernels"
# What a kernel module may import from the package besides the kernels themselves.
KERNEL_MAY_IMPORT = ("mla_sm120_plugin.kernels", "mla_sm120_plugin.errors")
KERNEL_MODULES = sorted(KERNELS.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """Every ``mla_sm120_plugin`` module ``path`` imports (relative imports resolved; for
    ``from X import name``, ``X.name`` when that is a module of the package, else ``X``)."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                candidate = PACKAGE.parent / Path(*child.split("."))
                is_module = candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists()
                found.add(child if is_module else module)
    return {m for m in found if m == "mla_sm120_plugin" or m.startswith("mla_sm120_plugin.")}


def _allowed(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in KERNEL_MAY_IMPORT)


def test_the_kernels_package_has_modules_to_check():
    names = {_module_name(p) for p in KERNEL_MODULES}
    assert {"mla_sm120_plugin.kernels.dsa.layout", "mla_sm120_plugin.kernels.dsa.triton"} <= names, names


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_kernel_module_imports_nothing_above_the_kernels(path):
    upward = sorted(m for m in package_imports(path) if not _allowed(m))
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}: kernels/ may import only {KERNEL_MAY_IMPORT}"


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_kernel_module_holds_no_hook_implementation(path):
    tree = ast.parse(path.read_text(), str(path))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    hooks = sorted(f.name for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("mla_sm120_"))
    assert "hookimpl" not in names and not hooks, f"{path.relative_to(PACKAGE)}: hookimpl or hook functions {hooks}"


# The package's floors, bottom first; a module may import its own floor and the ones below it.
LAYERS = (
    ("errors", "envs"),                                      # leaves: error types, environment variable names
    ("kernels",),                                            # pure kernels and the bytes they read
    ("files", "hfconfig", "types", "device", "engines", "config"),  # facts and settings (hfconfig: a config's keys)
    ("hooks", "modelinfo", "profiles", "rules", "families"),  # the hook mechanism; built-in profiles, pages, families
    ("selection", "context"),                                # the constraint matrix, the context builder
    ("plan", "report"),                                      # a model's plan per layer kind, rendered
    ("dispatch",),                                # catalog, binding, public entry, FlashInfer, self-check
    ("tools",),                                   # compile gate, bench
    ("integration", "cli", "__init__"),           # the engines' and the user's doors
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_architecture_page_puts_every_module_on_its_floor():
    """docs/architecture.md's floor table names each top-level module on the floor it has here (a module
    added, moved or removed without the page fails)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text.split("| floor | modules | holds |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    floors = [{name.split("/")[0].removesuffix(".py") for name in re.findall(r"`([\w/.]+)`", row.split("|")[2])}
              for row in rows]
    assert floors == [set(names) for names in LAYERS], floors


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert tops == set(RANK), sorted(tops ^ set(RANK))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    own = _layer(_module_name(path)) if path != PACKAGE / "__init__.py" else "__init__"
    upward = sorted(m for m in package_imports(path) if RANK[_layer(m)] > RANK[own])
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {RANK[own]}) imports {upward} from a layer above"


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package is its ``__init__``), in-function imports
    included, self-imports left out."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path)
        graph[name] = {m for m in package_imports(path) if m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_has_no_circle():
    """No module reaches itself through imports, at module level or inside a function (a face that
    its own rooms import back, two rules modules that import each other)."""
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, " -> ".join(cycle)


def test_the_circle_finder_sees_a_circle_through_an_in_function_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"p"}}) == ["p", "p.x", "p"]


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The reader above resolves relative and in-function imports (else the tests above could not fail)."""
    fake = tmp_path / "mla_sm120_plugin"
    (fake / "kernels" / "dsa").mkdir(parents=True)
    for rel in ("__init__.py", "selection.py", "errors.py", "kernels/__init__.py", "kernels/dsa/__init__.py",
                "dispatch/__init__.py", "dispatch/binding.py"):
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text("")
    module = fake / "kernels" / "dsa" / "k.py"
    module.write_text("from ...errors import KernelInputError\nfrom . import layout\n"
                      "def f():\n    from ...selection import select\n    from ...dispatch import binding\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = package_imports(module)
    assert found == {"mla_sm120_plugin.errors", "mla_sm120_plugin.kernels.dsa",
                     "mla_sm120_plugin.selection", "mla_sm120_plugin.dispatch.binding"}, found
    assert sorted(m for m in found if not _allowed(m)) == ["mla_sm120_plugin.dispatch.binding",
                                                            "mla_sm120_plugin.selection"]


PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_package_map_names_every_module_it_holds(package):
    """Each package's docstring is its map: a module it does not name is a room nobody finds."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    held = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    held += sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists())
    unnamed = [name for name in held if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", doc)]
    assert not unnamed, f"{package.relative_to(PACKAGE)}/__init__.py does not name {unnamed}"


# The rooms every model family shares: they ask a family through the table (mla_sm120_plugin.families)
# and never name one; a family is its families/ module, its kernel folder and its self-check case.
SHARED_ROOMS = ("plan.py", "report.py", "selection.py", "rules.py", "context.py", "dispatch/selfcheck.py",
                "dispatch/bound.py", "integration/vllm/translate.py", "integration/sglang/translate.py",
                "integration/sglang/bound.py")


def _family_names() -> set[str]:
    return {p.stem for p in (PACKAGE / "families").glob("*.py") if p.stem not in ("__init__", "base")}


@pytest.mark.parametrize("room", SHARED_ROOMS)
def test_a_shared_room_names_no_model_family(room):
    path = PACKAGE / room
    names = _family_names()
    assert {"dsa", "dsv4"} <= names  # the built-in families, each a module of its own
    own = {f"mla_sm120_plugin.families.{name}" for name in names} | {"mla_sm120_plugin.kernels.dsv4"}
    imported = sorted(m for m in package_imports(path) if any(m == o or m.startswith(o + ".") for o in own))
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    literals = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and id(n) not in docstrings and (n.value in names or n.value.startswith("dsv4"))})
    assert not imported and not literals, f"{room} names a family: imports {imported}, literals {literals}"


def test_the_family_check_sees_a_room_that_names_one(tmp_path, monkeypatch):
    """The check above reads imports and literals (else it could not fail)."""
    fake = tmp_path / "mla_sm120_plugin"
    (fake / "families").mkdir(parents=True)
    for rel in ("__init__.py", "families/__init__.py", "families/dsa.py", "families/dsv4.py"):
        (fake / rel).write_text("")
    (fake / "plan.py").write_text('"""doc naming dsv4."""\nfrom .families.dsv4 import NAME\nif x == "dsa":\n    pass\n')
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"imports \['mla_sm120_plugin.families.dsv4'\], literals \['dsa'\]"):
        test_a_shared_room_names_no_model_family("plan.py")
