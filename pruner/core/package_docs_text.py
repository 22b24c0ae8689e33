"""A third kind of text present offline wherever pruner runs: the long descriptions of its dependencies.

Project READMEs -- installation notes, feature lists, API sketches in Markdown or reStructuredText --
read with `importlib.metadata` from the installed distributions of a fixed list of packages
(`PACKAGES`: pruner's own dependencies, so every machine that runs pruner has them), never from the
network and never from whatever else happens to be installed. Each description is cut into sections at
its headings; a section goes to `dev` (for choosing methods) or `evaluation` (for reporting them) by the
first byte of the sha256 of its package, heading and occurrence, so the split of a section does not move
when another section or another package changes. Lines that are markup rather than prose (HTML, badges,
image directives) are dropped, and so are sections of fewer than `MIN_WORDS` words.

The text is the installed versions' READMEs: two machines agree on the split exactly when they
have the same versions, which go with every number measured on it (`versions()`).

Use it as a data source: `package-docs:dev`, `package-docs:evaluation`.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from importlib import metadata

PREFIX = "package-docs:"
SPLITS = ("dev", "evaluation")
MIN_WORDS = 30
# pyproject's `dependencies`, in its order: the fixed list the text comes from
PACKAGES = ("torch", "transformers", "datasets", "accelerate", "scikit-learn", "scipy", "numpy", "huggingface_hub",
            "safetensors", "matplotlib", "pydantic", "pyyaml", "tqdm", "tokenizers")
_RST_RULE = re.compile(r"^([=\-~^*#+`'\"])\1{2,}\s*$")
_MARKUP = ("<", "[![", "![", ".. image::", ".. |", ":target:", ":alt:", ":width:", ":height:", ".. raw::")


def description(package: str) -> str | None:
    """The installed package's long description (its README), or None when it is not installed or has none."""
    try:
        meta = metadata.metadata(package)
    except metadata.PackageNotFoundError:
        return None
    text = meta.get_payload() or meta.get("Description") or ""
    return text if text.strip() else None


def versions() -> dict[str, str | None]:
    """Each listed package's installed version (None: not installed): the identity of the text."""
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def _heading(lines: list[str], i: int, fenced: bool) -> str | None:
    """The heading that starts at line i (Markdown `#`, or reStructuredText text over a rule), else None."""
    line = lines[i].strip()
    if fenced or not line:
        return None
    if line.startswith("#"):
        return line.lstrip("#").strip() or None
    nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
    if _RST_RULE.match(nxt) and len(nxt) >= len(line) and not _RST_RULE.match(line):
        return line
    return None


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, prose) of each section of a README, in order; markup lines and rules dropped."""
    lines = text.splitlines()
    out, heading, body, fenced = [], "", [], False
    for i, raw in enumerate(lines):
        s = raw.strip()
        if s.startswith(("```", "~~~")):
            fenced = not fenced
        title = _heading(lines, i, fenced)
        if title is not None:
            out.append((heading, "\n".join(body).strip()))
            heading, body = title, []
        elif not s.startswith(_MARKUP) and not _RST_RULE.match(s):
            body.append(raw.rstrip())
    out.append((heading, "\n".join(body).strip()))
    return [(h, b) for h, b in out if len(b.split()) >= MIN_WORDS]


def split_of(key: str) -> str:
    """`dev` or `evaluation`, by the first byte of the sha256 of a section's key."""
    return SPLITS[hashlib.sha256(key.encode()).digest()[0] % 2]


@lru_cache(maxsize=None)
def texts(split: str) -> tuple[str, ...]:
    """The documents of one split: the sections of every listed package's README, in package order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} of {PREFIX.rstrip(':')}; valid: {', '.join(SPLITS)}")
    out = []
    for package in PACKAGES:
        text = description(package)
        if text is None:
            continue
        seen: dict[str, int] = {}
        for heading, body in sections(text):
            seen[heading] = seen.get(heading, 0) + 1
            if split_of(f"{package}/{heading}/{seen[heading]}") == split:
                out.append(body)
    if not out:
        raise FileNotFoundError(f"none of {', '.join(PACKAGES)} has a long description installed: "
                                f"{PREFIX}{split} needs them")
    return tuple(out)
