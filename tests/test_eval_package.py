"""eval/ as a package a newcomer can read: no import cycles, no sibling imports by path, every script's docstring
gives its command, the README's table names every script, and the driver's commands name scripts that exist."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"
NOT_SCRIPTS = {"eval", "eval.__main__", "eval.common", "eval.studies.recovery.measure"}  # the driver, shared code


def _modules() -> dict[str, Path]:
    """Every module of eval/, dotted name -> file; not what the scripts write under eval/results/ (a run folder's
    model/ holds its remote-code file, which is an artefact, not eval code)."""
    out = {}
    for path in sorted(p for p in EVAL.rglob("*.py") if (EVAL / "results") not in p.parents):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _scripts() -> dict[str, Path]:
    return {name: path for name, path in _modules().items()
            if name not in NOT_SCRIPTS and path.name != "__init__.py"}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports), or None."""
    done, path = set(), []

    def visit(m: str) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph[m]):
            found = visit(n)
            if found:
                return found
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        found = visit(m)
        if found:
            return found
    return None


@pytest.mark.unit
def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.unit
def test_eval_has_no_import_cycle_function_level_imports_included():
    g = grimp.build_graph("eval", include_external_packages=False)
    graph = {m: {n for n in g.find_modules_directly_imported_by(m) if n.split(".")[0] == "eval"}
             for m in g.modules if m.split(".")[0] == "eval"}
    assert len(graph) == len(_modules())  # grimp saw every module
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.unit
def test_eval_imports_its_own_modules_by_their_package_names():
    """`from eval.common import ...`, never `import bench_pruned` resolved through a script's folder on sys.path."""
    stems = {p.stem for p in EVAL.rglob("*.py")} - {"__init__", "__main__"}
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                    [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                    else ["." * node.level] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{name}:{node.lineno} {t}" for t in tops if t in stems or t.startswith(".")]
    assert not bad, bad


@pytest.mark.unit
def test_every_script_docstring_gives_its_command_and_what_it_writes():
    missing = []
    for name, path in _scripts().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if f"python -m {name}" not in doc:
            missing.append(f"{name}: no `python -m {name}` in its docstring")
        if not re.search(r"\b(writes?|prints?)\b", doc, re.I):
            missing.append(f"{name}: its docstring does not say what it writes")
    assert not missing, "\n".join(missing)


@pytest.mark.unit
def test_the_readme_table_names_every_script_and_only_scripts_that_exist():
    readme = (EVAL / "README.md").read_text()
    named = set(re.findall(r"`(eval(?:\.\w+)+)`", readme))
    assert set(_scripts()) <= named, sorted(set(_scripts()) - named)
    assert all(importlib.util.find_spec(n) for n in named), sorted(n for n in named if not importlib.util.find_spec(n))


@pytest.mark.unit
def test_the_driver_runs_existing_scripts_into_the_results_it_names():
    from eval.__main__ import TABLES, listing

    for name, table in TABLES.items():
        for step in table.steps:
            assert importlib.util.find_spec(step.module), f"{name}: no module {step.module}"
        for written in table.writes:
            assert written.startswith(("eval/results/", "runs/")), f"{name}: {written}"
            if written.startswith("eval/results/") and not re.search(r"[A-Z]{3,}", written):  # RECIPE, PART: patterns
                assert (ROOT / written).exists() or written.endswith(".png"), f"{name}: {written} is not there"
    text = listing()
    assert all(f"{name}  ->" in text for name in TABLES)
