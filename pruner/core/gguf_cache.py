"""GGUF files in: de-quantized once by transformers' own GGUF reader into a plain safetensors checkpoint folder.

Every stage of pruner reads a Hugging Face checkpoint folder (config.json, safetensors,
tokenizer files): layer-by-layer onloading reads its safetensors block by block,
provenance hashes its files, export copies its tokenizer. A `.gguf` file is none of
that, and de-quantizing it takes about a minute on 2 cores (Gemma 3 270M). So the file
is converted once, into a folder of the cache keyed by the file's sha256, and from then
on it *is* a local checkpoint folder: `resolve("x.gguf")` returns the folder.

The weights are stored in float32: that is what transformers' reader de-quantizes to,
and a Q4_K_M block's values (scale x 4-bit code - offset) are not exact in bfloat16.
The tokenizer comes from the same file. The folder is written under a temporary name
and renamed when complete, so a corrupt or truncated file, or an interrupted
conversion, leaves nothing behind; `source.json` inside records the file it came from.

Where: `$PRUNER_CACHE/gguf/<sha256[:16]>/` (default `~/.cache/pruner`); delete the
folder (or all of `gguf/`) to clear it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SOURCE_FILE = "source.json"
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A .gguf file pruner cannot read (not GGUF, truncated, or an architecture transformers cannot load)."""


def cache_root() -> Path:
    """Where converted GGUF checkpoints live: `$PRUNER_CACHE/gguf` (default `~/.cache/pruner/gguf`)."""
    return Path(os.environ.get("PRUNER_CACHE") or Path.home() / ".cache" / "pruner").expanduser() / "gguf"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its name; its contents are checked on conversion)."""
    return str(path).lower().endswith(".gguf")


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """The file's sha256, computed once per (path, size, modification time) in a process."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def folder(path: str | os.PathLike) -> Path:
    """The checkpoint folder a GGUF file converts to (converting it on first use)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    _check_header(path)
    out = cache_root() / sha256(path)[:16]
    if (out / SOURCE_FILE).exists():  # written last: the folder is complete
        return out
    with _locked(out):  # several processes (test workers, ranks) asking at once: one converts, the others wait
        if not (out / SOURCE_FILE).exists():
            _convert(path, out)
    return out


@contextlib.contextmanager
def _locked(out: Path):
    """An exclusive lock on `<out>.lock` for the length of the block (released if the process dies)."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def source_sha256(folder: Path) -> str | None:
    """The sha256 of the GGUF file a cache folder was converted from (None: not a converted folder)."""
    try:
        return json.loads((Path(folder) / SOURCE_FILE).read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        return None


def _check_header(path: Path) -> None:
    """Refuse a file that is not GGUF before transformers reads a byte of it."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def _convert(path: Path, out: Path) -> None:
    """De-quantize `path` with transformers' reader and write model + tokenizer to `out`, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"pruner: converting {path.name} to a safetensors checkpoint in {out} (once; about a minute on 2 cores "
          "for 270M parameters)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 - the GGUF reader fails on bad bytes in many ways (struct, numpy, KeyError)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GGUFError(f"cannot read {path} as a model ({first}); the file may be truncated or corrupt, or "
                            "its architecture is one transformers' GGUF reader does not load") from None
        _unmark_quantized(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": path.name, "sha256": sha256(path),
                                                   "bytes": path.stat().st_size, "dtype": "float32"}, indent=2))
        if out.exists():  # an incomplete folder from another process's interrupted conversion
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _unmark_quantized(model) -> None:
    """The weights are de-quantized float32 already; clear the GGUF quantizer's marks, which make transformers
    refuse `save_pretrained` ("quantized with gguf and is not serializable") and would land in config.json."""
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
