"""A second kind of text that is present offline wherever Python runs: the standard library's docstrings.

Technical English prose -- nothing like the shipped plays -- read straight from the running
interpreter's standard-library sources (parsed, never imported), one document per module.
Modules are split by a hash of their dotted name into `dev` (for choosing methods) and
`evaluation` (for reporting them), like the plays are split by whole play. Doctest lines
(`>>>`, `...`) are dropped, and so are docstrings of fewer than `MIN_WORDS` words (signatures,
one-liners). The text is the interpreter's: its version goes with every number measured on it
(`python_version()`).

Use it as a data source: `python-docs:dev`, `python-docs:evaluation`.
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from functools import lru_cache
from pathlib import Path

PREFIX = "python-docs:"
SPLITS = ("dev", "evaluation")
MIN_WORDS = 12
MIN_MODULE_WORDS = 150
# Not prose, or not the library's: tests, GUI demos, vendored and generated code, per-codec tables.
SKIP = {"test", "tests", "idle_test", "idlelib", "turtledemo", "tkinter", "lib2to3", "ensurepip", "site-packages",
        "dist-packages", "__pycache__", "pydoc_data", "encodings", "__phello__", "venv"}


def python_version() -> str:
    return platform.python_version()


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(module: str) -> str:
    """`dev` or `evaluation`, by the first byte of the module name's sha256 (stable across versions)."""
    return SPLITS[hashlib.sha256(module.encode()).digest()[0] % 2]


def _prose(doc: str) -> str | None:
    lines = [ln for ln in doc.splitlines() if not ln.lstrip().startswith((">>>", "..."))]
    text = "\n".join(lines).strip()
    return text if len(text.split()) >= MIN_WORDS else None


def module_text(path: Path) -> str | None:
    """The module's docstrings (module, classes, functions, in source order), or None when it has too few words."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    docs = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            text = _prose(doc) if doc else None
            if text and text not in docs:
                docs.append(text)
    text = "\n\n".join(docs)
    return text if len(text.split()) >= MIN_MODULE_WORDS else None


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every standard-library module kept."""
    root = stdlib()
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP & set(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


@lru_cache(maxsize=None)
def texts(split: str) -> tuple[str, ...]:
    """The documents of one split, sorted by module name."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} of {PREFIX.rstrip(':')}; valid: {', '.join(SPLITS)}")
    out = []
    for name, path in modules().items():
        if split_of(name) == split:
            text = module_text(path)
            if text:
                out.append(text)
    if not out:
        raise FileNotFoundError(f"no standard-library sources under {stdlib()}: {PREFIX}{split} needs them")
    return tuple(out)
