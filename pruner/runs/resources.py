"""Resources before compute: peak memory and disk space, estimated and checked before a run starts.

A calibration that runs out of memory after an hour, or a save that fills the
disk, loses the run. `calibration_estimate` adds up what a calibration pass holds
at its peak, from the model's geometry and the recipe's sizes:

- the model's weights (as loaded);
- the running statistics (float64 sums: pair matrices, output moments), twice
  (the total and the chunk being added);
- the larger of the two passes:
  - capture: one forward pass of a batch through the model's body (the residual
    stream, then the largest of: one layer's q/k/v with either the attention
    weights CPU SDPA materialises (batch, heads, T, T) or capture's own working
    set -- keys and values repeated over GQA groups in float32 and a chunk of
    `chunk_size` query rows against every key, several (batch, heads, chunk, keys)
    float32 tensors at once --, or the MLP's activations; no logits);
  - gradient (scorers that need it): one window's forward and backward, with every
    layer's activations kept for the backward.

`check_memory` compares it with what the device has free (available RAM, the
cgroup limit included, or free CUDA memory) and refuses, with the estimate and
the settings that would fit. `check_disk` does the same for a folder about to be
written. The estimate is compared with measured peaks of the shipped models by
`eval/bench/memory.py` (docs/troubleshooting.md).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pruner.core.runtime import model_bytes

GiB = 1 << 30
# float32 tensors of shape (batch, heads, chunk, keys) alive at once in `stats.chunk_stats` (scores, masked
# scores, weights, a log a, content rows, output-moment splits) and its pair metrics
CHUNK_COPIES = 8
# tensors of shape (tokens, d_model) a layer keeps for the backward pass (norms, q/k/v/o, residuals), in
# addition to its attention weights (heads, T, T) and MLP activations (3 x tokens x d_ffn)
BACKWARD_PER_LAYER = 10


class ResourceError(OSError):
    """Not enough memory or disk for what was asked; the message says how much and what to change."""


def gib(n: int | float) -> str:
    """Bytes for people: GiB with one decimal, else whole MiB, else whole KiB."""
    if n >= GiB / 10:
        return f"{n / GiB:.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


@dataclass(frozen=True)
class Sizes:
    """What a calibration pass processes: the recipe's sizes and what is captured."""

    batch_size: int
    length: int
    chunk_size: int = 128
    pair_metrics: int = 1          # how many pair metrics (cosine, js, ...) are captured
    outputs: bool = True           # output moments (scoring, compensation)
    joint: bool = True             # with them the joint second moment of all heads' outputs (CaptureConfig.joint)
    gradient: bool = False         # the gradient scorer's backward pass
    across_layers: bool = False    # pair matrices between all heads of the model (analyze)
    folds: int = 0                 # the output moments per calibration fold (refit's ridge `auto`)
    channels: bool = False         # the sink / content channels' second moments (CaptureConfig.channels)
    moments: str = "float64"       # storage of the finished joint second moments (CaptureConfig.moments)
    local: bool = False            # layer by layer, a per-layer budget's refit computed as each layer finishes


@dataclass(frozen=True)
class Estimate:
    """Peak bytes by part; `total` is their sum."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def text(self) -> str:
        return " + ".join(f"{k} {gib(v)}" for k, v in self.parts.items() if v) + f" = {gib(self.total)}"


def model_shape(model) -> dict[str, int]:
    from pruner.core import arch

    g, c = arch.geometry(model), model.config
    d = arch.o_weight_cols(model, 0).shape[0]
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    return {"L": g.n_layers, "H": g.n_heads, "KV": g.n_kv_heads, "D": g.head_dim, "d": d, "ffn": ffn,
            "V": getattr(c, "vocab_size", 0) or 0}


def statistics_bytes(model, sizes: Sizes) -> int:
    """The float64 sums a capture keeps: per layer pair matrices and output moments, twice (total + chunk)."""
    s = model_shape(model)
    L, H, D = s["L"], s["H"], s["D"]
    if sizes.across_layers:
        L, H = 1, s["L"] * s["H"]
    pairs = 2 * sizes.pair_metrics * H * H + 16 * H  # two conventions; per-head sums
    joint = (H * D) ** 2 if sizes.joint else 0
    moments = (3 * H * D + (3 if sizes.channels else 1) * H * D * D + joint) if sizes.outputs else 0
    moments += sizes.folds * (1 + H * D + (H * D) ** 2)
    return 2 * L * (pairs + moments) * 8


def finished_bytes(model, sizes: Sizes) -> int:
    """The finished sums a calibration hands on (one copy of `statistics_bytes`), the joint second moments
    (and the folds') in `sizes.moments`."""
    total = statistics_bytes(model, sizes) // 2
    if sizes.outputs and sizes.moments == "float32":
        s = model_shape(model)
        total -= s["L"] * (int(sizes.joint) + sizes.folds) * (s["H"] * s["D"]) ** 2 * 4
    return total


def calibration_estimate(model, sizes: Sizes) -> Estimate:
    """Peak memory of one calibration pass over batches of `sizes` (see the module docstring)."""
    from pruner.core.runtime import input_device

    s = model_shape(model)
    L, H, KV, D, d, ffn, V = (s[k] for k in ("L", "H", "KV", "D", "d", "ffn", "V"))
    a = next(model.parameters()).element_size()  # activation bytes follow the weights' dtype
    B, T, c = sizes.batch_size, sizes.length, min(sizes.chunk_size, sizes.length)
    tokens = B * T
    kept = 2 * tokens * d * a  # the residual stream in and out of a block (capture keeps no hidden states)
    qkv = tokens * ((H + 2 * KV) * D * 2 + H * D) * a  # q/k/v (and rotated copies), attention output
    sdpa = B * H * T * T * a if input_device(model).type == "cpu" else 0  # CPU SDPA holds the weights
    mlp = 3 * tokens * ffn * a
    logits = 0  # capture runs the model's body (`model.base_model`): no language-model head, no logits
    up = 0 if a >= 4 else 2 * B * H * T * D * 4  # half precision: query and key in float32
    repeated = B * H * T * D * 4 * (2 if sizes.outputs else 1)  # keys (and values) over GQA groups
    chunk = CHUNK_COPIES * B * H * c * T * 4
    if sizes.outputs:
        chunk += 4 * B * H * c * D * 8  # sink, content and whole outputs, and their flattened copy (float64)
    if sizes.across_layers:
        repeated = 2 * L * B * H * T * D * 4  # every layer's queries and keys, until the forward ends
        chunk = CHUNK_COPIES * B * L * H * c * T * 4 + 2 * sizes.pair_metrics * B * c * (L * H) ** 2 * 8
    plain = kept + max(qkv + sdpa, mlp, logits)
    with_capture = kept + max(qkv + max(sdpa, up + repeated + chunk), mlp, logits)
    grad = 0
    if sizes.gradient:  # one window at a time, every layer's activations kept for the backward
        grad = L * (BACKWARD_PER_LAYER * T * d * a + H * T * T * 4 + 3 * T * ffn * a) + 3 * T * V * 4
    parts = {"model": model_bytes(model), "statistics": statistics_bytes(model, sizes)}
    if with_capture >= grad:
        parts.update({"activations": plain, "capture": with_capture - plain})
    else:
        parts.update({"gradient pass": grad})
    return Estimate(parts)


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes free for this process now: free CUDA memory, or available RAM within any cgroup limit."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None  # planning elsewhere
    if device.type != "cpu":
        return None  # other accelerators: not checked
    free = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free.append(int(meminfo["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    for limit, usage, stat in (("memory.max", "memory.current", "memory.stat"),
                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                "memory/memory.stat")):
        root = Path("/sys/fs/cgroup")
        try:
            cap = (root / limit).read_text().strip()
            if cap == "max" or int(cap) >= 1 << 60:
                continue
            stats = dict(line.split() for line in (root / stat).read_text().splitlines())
            cache = int(stats.get("inactive_file", stats.get("total_inactive_file", 0)))
            free.append(int(cap) - int((root / usage).read_text()) + cache)
        except (OSError, ValueError):
            continue
    return min(free) if free else None


def sharing(device: str | torch.device) -> int:
    """How many processes share `device`'s free memory: the local processes of one machine share its RAM (each
    GPU is its own)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(device).type == "cpu" else 1


def _fits(model, sizes: Sizes, room: int) -> list[str]:
    """Settings that would fit in `room` bytes beyond the loaded model (at most two suggestions)."""
    base = model_bytes(model)
    out = []
    b = sizes.batch_size // 2
    while b >= 1:
        est = calibration_estimate(model, replace(sizes, batch_size=b))
        if est.total - base <= room:
            out.append(f"calibration.batch_size: {b} (about {gib(est.total)})")
            break
        b //= 2
    if sizes.folds:  # the fold moments of ridge auto are (folds x) the layers' largest sums
        est = calibration_estimate(model, replace(sizes, folds=0))
        if est.total - base <= room:
            out.append(f"surgery.ridge: a number such as 0.1 instead of auto (no fold moments: about {gib(est.total)})")
    c = sizes.chunk_size // 2
    while c >= 8 and not out:
        est = calibration_estimate(model, replace(sizes, chunk_size=c))
        if est.total - base <= room:
            out.append(f"capture.chunk_size: {c} (about {gib(est.total)})")
            break
        c //= 2
    return out


def check_memory(model, sizes: Sizes, device: str | torch.device | None = None, what: str = "calibration") -> Estimate:
    """Refuse, before any compute, a pass whose estimated peak exceeds the free memory of `device`.

    The model is already loaded, so what must still fit is the estimate minus the
    model's own bytes. Returns the estimate.
    """
    from pruner.core.runtime import input_device

    device = device or input_device(model)
    est = calibration_estimate(model, sizes)
    free = available_memory(device)
    procs = sharing(device)
    if free is None or procs * (est.total - est.parts["model"]) <= free:
        return est
    free //= procs
    hints = _fits(model, sizes, free)
    half = " or model.dtype: bfloat16 (half the weights and activations)" if next(model.parameters()).element_size() >= 4 \
        else ""
    more = " or model.device_map: auto (spread the model over several GPUs)" if torch.device(device).type == "cuda" \
        else ""
    raise ResourceError(
        f"not enough memory for {what}: its peak is about {gib(est.total)} ({est.text()}), and only "
        f"{gib(free)} is free on {device} beyond the loaded model; lower "
        + (", or ".join(hints) if hints else "calibration.batch_size and capture.chunk_size")
        + f"{half}{more}")


def free_disk(folder: Path) -> int:
    """Free bytes on the filesystem that holds `folder` (or its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_disk(folder: Path, need: int, what: str) -> None:
    """Refuse to start writing `need` bytes into `folder` (a run's partial folder) when its filesystem
    has less free; the message names the folder it sits in."""
    free = free_disk(folder)
    if need > free:
        raise ResourceError(f"not enough disk space in {Path(folder).absolute().parent}: {what} needs about "
                            f"{gib(need)}, and {gib(free)} is free there; free some space or choose another --out")


def checkpoint_bytes(model) -> int:
    """What saving the (dense) model takes on disk: its weights in their dtype, plus a margin for
    the tokenizer and config files."""
    return int(model_bytes(model) * 1.02) + (20 << 20)



def checkpoint_model_bytes(folder: Path, dtype: str) -> int | None:
    """The bytes a checkpoint folder's weights take in memory in `dtype`, from its safetensors headers alone
    (None when it has none)."""
    from pruner.checkpoints.storage import weight_files, weight_numel

    files = weight_files(folder)
    return None if not files else weight_numel(files) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def onload_mode(mode: str, folder: Path | None, dtype: str, device: str) -> str:
    """`all` or `sequential` for a recipe's `capture.onload` (`auto`: sequential when the weights alone would
    take more than 80% of the device's free memory; a model given in memory (`folder` None) is resident)."""
    if mode != "auto":
        return mode
    if folder is None:
        return "all"
    need, free = checkpoint_model_bytes(folder, dtype), available_memory(device)
    return "sequential" if need is not None and free is not None and need > 0.8 * free else "all"
