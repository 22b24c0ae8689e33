"""Where the teacher's distributions come from: the teacher itself beside the student (`resident`), or a
top-k cache on disk written by one pass of the teacher before training (`cached`).

The cache keeps, per recovery token, the teacher's k largest log-probabilities, their
token ids and the log of the remaining mass (`loss.topk_targets`), and m tokens sampled
from the teacher's tail with their log-probabilities (`loss.tail_samples`, seeded), in
memory-mapped .npy files: 8k + 4 + 8m bytes a token (k = 64, m = 8: 580 B, 2.4 GB for 4M
tokens) instead of the vocabulary's 4V. With the samples the loss (and the guard's
validation KL) estimates the full-vocabulary KL without bias; m = 0 keeps the collapsed
lower bound. A teacher that does not fit in memory runs its pass one block at a time from
its checkpoint (`onloader`: every batch through block 0, then block 1, ..., as calibration
does), and is never whole in memory. Training then holds only the student; the teacher is released after
the pass. The disk is checked for room before the pass, and a complete cache (its
`done` marker) is reused by a resumed recovery.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pruner.core import data
from pruner.core.runtime import input_device
from pruner.recovery import loss
from pruner.recovery.data import RecoveryError


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ids and mask -> (B, T, V) logits."""
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def teacher_logits(teacher, windows: data.TokenBatch, batch_size: int, onloader=None,
                   progress: bool = False) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, (b, T, V) logits) for every batch of `windows`: the whole teacher (the logits on its device), or with
    `onloader` one block at a time on the onloader's device (its hidden states kept between blocks; the model's own
    code after the blocks gives the logits, returned on the CPU)."""
    n = len(windows.input_ids)
    parts = [slice(i, i + batch_size) for i in range(0, n, batch_size)]
    bar = tqdm(parts, desc="teacher top-k cache", unit="batch", disable=not progress)
    if onloader is None:
        dev = input_device(teacher)
        for sl in bar:
            yield sl, forward_logits(teacher, windows.input_ids[sl].to(dev), windows.attention_mask[sl].to(dev))
        return
    from pruner.core.layerwise import blockwise

    device = onloader.device
    with blockwise(teacher, onloader, [(windows.input_ids[sl], windows.attention_mask[sl]) for sl in parts],
                   device) as (calls, replay):
        for sl, call in zip(bar, calls):
            replay.hidden = call.hidden
            yield sl, forward_logits(teacher, windows.input_ids[sl].to(device),
                                     windows.attention_mask[sl].to(device)).cpu()


class Resident:
    """The teacher runs on every batch (no gradient)."""

    kind = "resident"

    def __init__(self, teacher, temperature: float = 1.0):
        self.teacher, self.temperature = teacher, temperature

    def kl(self, student_logits, rows: torch.Tensor, batch: data.TokenBatch):
        """Summed KL and real-token count for the batch's windows `rows` (their indices in the cached order)."""
        with torch.no_grad():
            dev = input_device(self.teacher)
            t = forward_logits(self.teacher, batch.input_ids.to(dev), batch.attention_mask.to(dev))
        t = t.to(student_logits.device)
        return loss.full_kl(student_logits, t, batch.attention_mask, self.temperature)


def cache_bytes(windows: int, length: int, k: int, m: int = 0) -> int:
    """Disk the top-k cache takes: k float32 log-probabilities, k int32 ids, one float32 tail, and m tail samples
    (int32 id, float32 log-probability) per token."""
    return windows * length * (8 * k + 4 + 8 * m)


def check_disk(folder: Path, need: int) -> None:
    """Refuse, before the teacher's pass, a cache the disk cannot hold (with 5% to spare)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need * 1.05 > free:
        raise RecoveryError(f"recovery.teacher: cached needs {need / 2**30:.2f} GiB for the top-k cache in {folder} "
                            f"and {free / 2**30:.2f} GiB is free; free some disk, lower recovery.top_k or "
                            "recovery.tokens, or use recovery.teacher: resident")


@dataclass(frozen=True)
class CacheSpec:
    """What `Cached.build` keeps of each token's teacher distribution."""

    k: int                     # the top-k probabilities and token ids kept
    temperature: float = 1.0   # the distillation temperature the targets are taken at
    tail_samples: int = 0      # tokens sampled from the rest of the vocabulary, with their log-probabilities
    seed: int = 0              # the tail samples' generator


class Cached:
    """The teacher's top-k log-probabilities for every recovery window, on disk (rows: windows in order)."""

    kind = "cached"

    def __init__(self, folder: Path, temperature: float = 1.0):
        self.folder, self.temperature = Path(folder), temperature
        self.top = np.load(self.folder / "top.npy", mmap_mode="r")     # (N, T, k) float32
        self.idx = np.load(self.folder / "idx.npy", mmap_mode="r")     # (N, T, k) int32
        self.tail = np.load(self.folder / "tail.npy", mmap_mode="r")   # (N, T) float32
        sampled = (self.folder / "sid.npy").exists()
        self.sid = np.load(self.folder / "sid.npy", mmap_mode="r") if sampled else None  # (N, T, m) int32
        self.slp = np.load(self.folder / "slp.npy", mmap_mode="r") if sampled else None  # (N, T, m) float32

    def kl(self, student_logits, rows: torch.Tensor, batch: data.TokenBatch):
        r = rows.numpy()

        def rows_of(a):
            return torch.from_numpy(np.ascontiguousarray(a[r])).to(student_logits.device)

        samples = None if self.sid is None else (rows_of(self.sid), rows_of(self.slp))
        return loss.topk_kl(student_logits, rows_of(self.top), rows_of(self.idx), rows_of(self.tail),
                            batch.attention_mask, self.temperature, samples)

    @staticmethod
    @torch.no_grad()
    def build(teacher, windows: data.TokenBatch, folder: Path, spec: CacheSpec, batch_size: int = 8,
              progress: bool = False, onloader=None) -> "Cached":
        """One pass of the teacher over `windows` (N, T) into `folder` (`spec.tail_samples` tail samples a token,
        drawn from a generator seeded by `spec.seed`; with `onloader`, a block at a time); reused when already
        complete."""
        k, temperature, m, seed = spec.k, spec.temperature, spec.tail_samples, spec.seed
        folder = Path(folder)
        if (folder / "done").exists():
            return Cached(folder, temperature)
        n, T = windows.input_ids.shape
        check_disk(folder, cache_bytes(n, T, k, m))
        k = min(k, teacher.config.vocab_size)
        arrays = {"top": (np.float32, (n, T, k)), "idx": (np.int32, (n, T, k)), "tail": (np.float32, (n, T))}
        if m:
            arrays.update(sid=(np.int32, (n, T, m)), slp=(np.float32, (n, T, m)))
        out = {name: np.lib.format.open_memmap(folder / f"{name}.npy", "w+", *kind) for name, kind in arrays.items()}
        g = torch.Generator().manual_seed(seed)
        for sl, logits in teacher_logits(teacher, windows, batch_size, onloader, progress):
            for i in range(logits.shape[0]):  # a window at a time: a few (T, V) float32 copies, not (b, T, V) ones;
                one = logits[i:i + 1].cpu()  # the same draws (the CPU generator serves the rows in order)
                got = dict(zip(("top", "idx", "tail"), loss.topk_targets(one, k, temperature)))
                if m:
                    got.update(zip(("sid", "slp"), loss.tail_samples(one, got["idx"], m, g, temperature)))
                for name, value in got.items():
                    out[name][sl.start + i:sl.start + i + 1] = value.numpy()
        for a in out.values():
            a.flush()
        del out
        (folder / "done").write_text("complete\n")
        return Cached(folder, temperature)
