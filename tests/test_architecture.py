"""The house: layered imports (import-linter), rooms of one job (size limits), docs that build and name only
what exists. These run in the test command, so no cycle, upward import, oversized module or stale name lands."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
LAYERS = ("core", "attention", "pruning", "analysis", "checkpoints", "evaluation", "runs", "api", "commands")


def _tool(name: str) -> str:
    """A console script of the test extra, next to this interpreter (its absence fails, never skips)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: it is part of the test extra (pip install -e '.[test]')"
    return found


@pytest.mark.unit
def test_import_layers_hold():
    """`lint-imports` with the contracts in pyproject.toml: layers, pure math, independent siblings."""
    out = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.mark.unit
def test_no_undefined_or_unused_names():
    """`ruff check --select F,E9`: undefined names, unused imports, syntax errors (a moved function caught early)."""
    out = subprocess.run([_tool("ruff"), "check", "--no-cache", "--select", "F,E9", "pruner", "tests", "eval", "scripts"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


@pytest.mark.unit
def test_no_module_over_400_lines_and_no_function_over_60():
    big, long = [], []
    scripts = [*(ROOT / "eval").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    for path in sorted([*(ROOT / "pruner").rglob("*.py"), *scripts]):
        text = path.read_text()
        if path.is_relative_to(ROOT / "pruner") and len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not big and not long, "\n".join(big + long)


@pytest.mark.unit
def test_every_layer_says_its_job_in_one_line():
    for layer in LAYERS:
        doc = importlib.import_module(f"pruner.{layer}").__doc__
        summary = (doc or "").strip().split("\n\n")[0]
        assert summary and len(summary.splitlines()) == 1, f"pruner.{layer}: a one-line summary of its job wanted"


@pytest.mark.unit
def test_eval_scripts_import_the_installed_package():
    """No `sys.path` edits: eval/, scripts/ and the test helpers import pruner as installed (editable)."""
    hacks = [str(p.relative_to(ROOT)) for p in [*(ROOT / "eval").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
                                                 *(ROOT / "tests").glob("*.py")]
             if re.search(r"^\s*sys\.path(\.insert|\[)", p.read_text(), re.M)]
    assert not hacks, hacks


def _dotted_names(text: str) -> set[str]:
    return set(re.findall(r"\bpruner(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.unit
def test_docs_name_only_modules_and_objects_that_exist():
    """Every `pruner.x.y` the README, the docs pages, the recipes and the shipped task YAMLs mention imports."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "recipes").glob("*.yaml"),
             *(ROOT / "pruner" / "assets" / "tasks").rglob("*.yaml")]
    stale = sorted({f"{f.relative_to(ROOT)}: {n}" for f in files for n in _dotted_names(f.read_text())
                    if not _resolves(n.rstrip("."))})
    assert not stale, "\n".join(stale)


@pytest.mark.unit
def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual belongs in docs/"
    for link in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (ROOT / link).exists(), link


@pytest.mark.integration
def test_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or an API name mkdocstrings cannot find, fails."""
    out = subprocess.run([_tool("mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    index = (tmp_path / "site" / "index.html").read_text()
    change = re.search(r"\(change [+-][0-9.]+", (ROOT / "README.md").read_text()).group(0)
    assert "recipes/quickstart.yaml" in index and change in index  # the README's quick start, included
    assert "pruner.api.pruning.prune" in (tmp_path / "site" / "reference" / "index.html").read_text()
