"""Reading a checkpoint without loading it: its safetensors headers, storage dtype, and whether config and weights agree."""

from __future__ import annotations

import json
import math
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from pruner.core import assets

DTYPES = ("float32", "float16", "bfloat16")


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, would not reload, or does not match its config."""


def read_header(f: Path) -> dict:
    """`header_of(f)`'s header alone."""
    return header_of(f)[0]


def header_of(f: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> {"dtype", "shape", "data_offsets"}, and "__metadata__"), read
    without reading a tensor; a file whose header does not parse -- random bytes, a truncated or foreign file --
    is one CheckpointError naming it (its first 8 bytes would otherwise ask for a header of any size). Returns the
    header and its length in bytes (the tensors start after 8 + that)."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        bad = [k for k, t in (header.items() if isinstance(header, dict) else []) if k != "__metadata__" and not
               (isinstance(t, dict) and {"dtype", "shape", "data_offsets"} <= t.keys())]
        if not isinstance(header, dict) or bad:
            raise ValueError("the header is not a table of tensors" + (f" ({bad[0]!r})" if bad else ""))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({e}); the download or copy is corrupt: "
                              "fetch that shard again") from None
    return header, n


def _headers(files: list[Path]) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", ...} from safetensors headers (no tensor is read)."""
    out = {}
    for f in files:
        out.update({k: v for k, v in read_header(f).items() if k != "__metadata__"})
    return out


def weight_numel(files: list[Path]) -> int:
    """Elements of every floating tensor in safetensors files (headers only)."""
    return sum(math.prod(t["shape"]) for t in _headers(files).values() if t["dtype"] in _SAFETENSORS_DTYPES)


def _safetensors_dtypes(files: list[Path]) -> dict[str, int]:
    """Element count per floating dtype over the tensors of safetensors files."""
    counts: dict[str, int] = {}
    for t in _headers(files).values():
        if t["dtype"] in _SAFETENSORS_DTYPES:
            name = _SAFETENSORS_DTYPES[t["dtype"]]
            counts[name] = counts.get(name, 0) + math.prod(t["shape"])
    return counts


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded or not); empty when it has none."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").exists() else []


def storage_dtype(spec) -> str | None:
    """The dtype the base checkpoint of a recipe's `model` section stores its weights in.

    Read from the safetensors headers (the shipped checkpoints say float32 in config.json
    but hold float16 weights), else config.json's dtype. A Hub id is read from the local
    cache. None when no checkpoint can be found (a model built in memory): keep the model's.
    """
    try:
        path = assets.resolve("minilm" if spec.mlm_readout else spec.path)
    except OSError:
        return None
    folder = Path(path)
    if not folder.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            folder = Path(cached).parent if isinstance(cached, str) else folder
        except Exception:  # noqa: BLE001 - not an id the cache knows
            return None
    counts = _safetensors_dtypes(weight_files(folder)) if folder.exists() else {}
    if counts:
        return max(counts, key=counts.get)
    config = folder / "config.json"
    if config.exists():
        d = json.loads(config.read_text())
        declared = d.get("dtype") or d.get("torch_dtype")
        if declared in DTYPES:
            return declared
    return None


@contextmanager
def _params_as(model, convert) -> Iterator[None]:
    """Every floating parameter temporarily replaced by `convert(tensor)` (restored on exit)."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                saved.append((p, p.data))
                p.data = convert(p.data)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def stored_as(model, dtype: torch.dtype):
    """`with stored_as(model, float16):` the parameters are what a float16 file holds (for saving)."""
    return _params_as(model, lambda t: t.to(dtype))


def rounded_to(model, dtype: torch.dtype):
    """`with rounded_to(model, float16):` the parameters are rounded to float16, kept in their own dtype:
    the model a float16 checkpoint reloads as."""
    return _params_as(model, lambda t: t.to(dtype).to(t.dtype))


def check_weights(build, folder: Path) -> None:
    """Refuse, in one line, a config whose head counts do not match the weights (an edited config.json).

    The model is built on the meta device (no memory) and each tensor's shape compared
    with the safetensors headers; only the attention projections can disagree here.
    """
    files = weight_files(folder)
    if not files:
        return
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - a config the meta build cannot take: the load itself will say what is wrong
        return
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = {k: tuple(v["shape"]) for k, v in _headers(files).items()}
    prefix = f"{model.base_model_prefix}."
    for key, shape in stored.items():
        want = expected.get(key, expected.get(key.removeprefix(prefix)))
        if want is not None and want != shape:
            raise CheckpointError(
                f"{folder}: config.json does not match the weights: {key} is {list(shape)} in the checkpoint but "
                f"{list(want)} by the config's head counts (was config.json edited, or copied from another "
                "checkpoint?)")


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


def check_shards(folder: Path) -> dict[str, Path]:
    """Every safetensors shard of a checkpoint read far enough to know it is whole: its header parses, every
    tensor's byte range fits the file and matches its dtype and shape. Returns tensor name -> shard.

    A truncated, corrupt or missing shard is one CheckpointError naming it, before any weight is read
    (memory-mapping a file of random bytes otherwise ends in an unexpected MemoryError).
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        missing = sorted({f for f in json.loads(index.read_text())["weight_map"].values()
                          if not (folder / f).exists()})
        if missing:
            raise CheckpointError(f"{folder}: the index names shards that are missing: {', '.join(missing)}")
    where: dict[str, Path] = {}
    for f in weight_files(folder):
        size = f.stat().st_size
        header, n = header_of(f)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            want = math.prod(t["shape"]) * _ITEMSIZE.get(t["dtype"], 0)
            if end > size - 8 - n or (want and end - start != want):
                raise CheckpointError(f"{f}: tensor {name} runs past the end of the file ({size:,} bytes): the shard "
                                      "is truncated; fetch it again")
            where[name] = f
    return where
