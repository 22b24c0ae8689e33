"""No import cycles, inside a subpackage included, imports inside functions included.

The layers contract (lint-imports) forbids imports that go up between subpackages; it cannot see a cycle
between two modules of the same subpackage (runs/folders -> runs/pipeline -> runs/recovery_stage -> runs/folders
was one, closed through imports inside functions). grimp builds the graph lint-imports checks, with every
import in a file, at module level or not, so a cycle found here is one Python could hit at run time.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
# pruner is always checked; eval/ once it is a package (an eval/__init__.py), skipped in one line before
ALWAYS, ONCE_A_PACKAGE = ("pruner",), ("eval",)


def _graph(root: str, monkeypatch) -> grimp.ImportGraph:
    """The import graph of package `root` found from the repository root (eval/ is not installed)."""
    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.find_spec(root)
    is_package = spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")
    if root in ALWAYS:
        assert is_package, f"{root} is not importable as a package from {ROOT}"
    elif not is_package:
        pytest.skip(f"{root}/ is not a package (no __init__.py) yet")
    assert Path(spec.origin).is_relative_to(ROOT), f"{root} resolves outside the repository: {spec.origin}"
    return grimp.build_graph(root, cache_dir=None)


def cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every import cycle, once each: for each direct import a -> b, the shortest chain back b -> ... -> a.
    A cycle is written from its smallest module name, so the same loop found from each of its edges is one."""
    found = set()
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                loop = (importer, *back[:-1])  # importer -> imported -> ... -> (importer)
                start = loop.index(min(loop))
                found.add(loop[start:] + loop[:start])
    return sorted(found)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def nested_imports(root: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(importer, module, names) for every import of `root`'s own modules made inside a function or class
    body: the imports a graph of module-level statements alone would miss."""
    found = []
    for path in sorted((ROOT / root).rglob("*.py")):
        importer = _module_name(path)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if id(node) in top:
                continue
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                if base.split(".")[0] == root:
                    found.append((importer, base, tuple(a.name for a in node.names)))
            elif isinstance(node, ast.Import):
                found += [(importer, a.name, ()) for a in node.names if a.name.split(".")[0] == root]
    return found


@pytest.mark.unit
@pytest.mark.parametrize("root", ALWAYS + ONCE_A_PACKAGE)
def test_no_import_cycles(root, monkeypatch):
    graph = _graph(root, monkeypatch)
    assert len(graph.modules) > 1
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join((*c, c[0])) for c in found)


@pytest.mark.unit
@pytest.mark.parametrize("root", ALWAYS + ONCE_A_PACKAGE)
def test_the_graph_holds_the_imports_inside_functions(root, monkeypatch):
    """The premise of the cycle test and of lint-imports' layers: grimp records an import written inside a
    function like one at the top of the file. Each such import is an edge of the graph."""
    graph = _graph(root, monkeypatch)
    nested = nested_imports(root)
    if root in ALWAYS:
        assert len(nested) > 10, nested  # pruner imports heavy modules inside functions; the check is not empty
    missing = [f"{importer}: {module} {names}" for importer, module, names in nested
               if not any(graph.direct_import_exists(importer=importer, imported=target)
                          for target in (module, *(f"{module}.{n}" for n in names)))]
    assert not missing, "\n".join(missing)
