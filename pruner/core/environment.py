"""What made a result: pruner's version and source, Python and the libraries, the machine it ran on.

One record for every file that says where a number came from (provenance.json, analysis.json,
bench figures, the `eval/` scripts' JSON), so they cannot disagree on what they call things.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from pruner.core.version import __version__

PACKAGE = Path(__file__).resolve().parents[1]  # the pruner package


def sha256(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of a file, read in chunks (weights files are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def digest(files: dict[str, str]) -> str:
    """One sha256 over named file digests, independent of their order."""
    return hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()


def source_hash() -> str:
    """sha256 over pruner's own Python source: which code made the run, beyond the version number."""
    return digest({str(p.relative_to(PACKAGE)): sha256(p) for p in sorted(PACKAGE.rglob("*.py"))})


def versions() -> dict:
    """Python, torch and transformers versions."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def record() -> dict:
    """pruner's version and source hash, and `versions()` as `environment`: the head of every provenance record."""
    return {"pruner_version": __version__, "pruner_source_sha256": source_hash(), "environment": versions()}


def machine() -> dict:
    """The CPU count, torch's threads and the load average now: what a timed figure needs beside it."""
    import torch

    return {"cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "processor": platform.processor() or "cpu"}
