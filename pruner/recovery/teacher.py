"""Where the teacher's distributions come from: the teacher itself beside the student (`resident`), or a
top-k cache on disk written by one pass of the teacher before training (`cached`).

The cache keeps, per recovery token, the teacher's k largest log-probabilities, their
token ids and the log of the remaining mass (`loss.topk_targets`), in memory-mapped
.npy files: 8k + 4 bytes a token (k = 64: 516 B, 2.1 GB for 4M tokens) instead of the
vocabulary's 4V. Training then holds only the student; the teacher is released after
the pass. The disk is checked for room before the pass, and a complete cache (its
`done` marker) is reused by a resumed recovery.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pruner.core import data
from pruner.recovery import loss
from pruner.recovery.data import RecoveryError


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) ids and mask -> (B, T, V) logits."""
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


class Resident:
    """The teacher runs on every batch (no gradient)."""

    kind = "resident"

    def __init__(self, teacher, temperature: float = 1.0):
        self.teacher, self.temperature = teacher, temperature

    def kl(self, student_logits, rows: torch.Tensor, batch: data.TokenBatch):
        """Summed KL and real-token count for the batch's windows `rows` (their indices in the cached order)."""
        with torch.no_grad():
            t = forward_logits(self.teacher, batch.input_ids, batch.attention_mask)
        return loss.full_kl(student_logits, t, batch.attention_mask, self.temperature)


def cache_bytes(windows: int, length: int, k: int) -> int:
    """Disk the top-k cache takes: k float32 log-probabilities, k int32 ids and one float32 tail per token."""
    return windows * length * (8 * k + 4)


def check_disk(folder: Path, need: int) -> None:
    """Refuse, before the teacher's pass, a cache the disk cannot hold (with 5% to spare)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need * 1.05 > free:
        raise RecoveryError(f"recovery.teacher: cached needs {need / 2**30:.2f} GiB for the top-k cache in {folder} "
                            f"and {free / 2**30:.2f} GiB is free; free some disk, lower recovery.top_k or "
                            "recovery.tokens, or use recovery.teacher: resident")


class Cached:
    """The teacher's top-k log-probabilities for every recovery window, on disk (rows: windows in order)."""

    kind = "cached"

    def __init__(self, folder: Path, temperature: float = 1.0):
        self.folder, self.temperature = Path(folder), temperature
        self.top = np.load(self.folder / "top.npy", mmap_mode="r")     # (N, T, k) float32
        self.idx = np.load(self.folder / "idx.npy", mmap_mode="r")     # (N, T, k) int32
        self.tail = np.load(self.folder / "tail.npy", mmap_mode="r")   # (N, T) float32

    def kl(self, student_logits, rows: torch.Tensor, batch: data.TokenBatch):
        r = rows.numpy()
        top, idx, tail = (torch.from_numpy(np.ascontiguousarray(a[r])) for a in (self.top, self.idx, self.tail))
        return loss.topk_kl(student_logits, top, idx, tail, batch.attention_mask, self.temperature)

    @staticmethod
    @torch.no_grad()
    def build(teacher, windows: data.TokenBatch, folder: Path, k: int, temperature: float = 1.0,
              batch_size: int = 8, progress: bool = False) -> "Cached":
        """One pass of the teacher over `windows` (N, T) into `folder`; reused when already complete."""
        folder = Path(folder)
        if (folder / "done").exists():
            return Cached(folder, temperature)
        n, T = windows.input_ids.shape
        check_disk(folder, cache_bytes(n, T, k))
        k = min(k, teacher.config.vocab_size)
        top = np.lib.format.open_memmap(folder / "top.npy", "w+", np.float32, (n, T, k))
        idx = np.lib.format.open_memmap(folder / "idx.npy", "w+", np.int32, (n, T, k))
        tail = np.lib.format.open_memmap(folder / "tail.npy", "w+", np.float32, (n, T))
        for i in tqdm(range(0, n, batch_size), desc="teacher top-k cache", unit="batch", disable=not progress):
            sl = slice(i, i + batch_size)
            logits = forward_logits(teacher, windows.input_ids[sl], windows.attention_mask[sl])
            t, j, r = loss.topk_targets(logits, k, temperature)
            top[sl], idx[sl], tail[sl] = t.numpy(), j.numpy(), r.numpy()
        for a in (top, idx, tail):
            a.flush()
        del top, idx, tail
        (folder / "done").write_text("complete\n")
        return Cached(folder, temperature)
