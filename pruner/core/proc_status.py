"""A process's memory as Linux counts it (`/proc/PID/status`): the one reader pruner, eval/ and the tests use.

`VmRSS` is the resident set, `VmHWM` its peak ("high water mark"), `RssAnon` the anonymous part of it (heap and
private mappings: what the process allocated, not the page cache of files it maps, such as memory-mapped weights)
and `RssFile` the file-backed part. Writing 5 to `/proc/self/clear_refs` resets `VmHWM` to the current resident
set, so a block's peak growth is `VmHWM` after it minus `VmRSS` before it -- unlike `ru_maxrss`, which keeps a
parent's peak across fork/exec. A peak that `VmHWM` cannot see (anonymous memory alone, another process's) is
sampled on a thread instead: torch releases the GIL in its kernels, so a sample lands inside the operation that
allocated. Off Linux every reader returns nothing rather than failing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def status(pid: int | str = "self") -> dict[str, int]:
    """Every memory field of `/proc/PID/status` (those counted in kB: VmRSS, VmHWM, RssAnon, RssFile, ...), in
    bytes; empty where there is no such file (not Linux, or the process has gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if value.endswith(" kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset this process's `VmHWM` to its current resident set; whether it could (Linux only)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakGrowth:
    """The peak resident growth of a block, in bytes (`.bytes`): `VmHWM` at its end minus `VmRSS` at its start,
    the peak reset at the start; None where /proc cannot say."""

    def __enter__(self) -> PeakGrowth:
        self.bytes = None
        self._start = status().get("VmRSS") if reset_peak() else None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            self.bytes = status()["VmHWM"] - self._start


class Sampler:
    """The peaks of some fields of a process's status (`.peaks`, bytes), sampled on a background thread every
    `every` seconds while the block runs, and once more at its end. Clearing `.peaks` starts the peaks afresh."""

    def __init__(self, pid: int | str = "self", fields: tuple[str, ...] = ("RssAnon",), every: float = 0.002):
        self.pid, self.fields, self.every = pid, fields, every
        self.peaks: dict[str, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for key, value in status(self.pid).items():
            if key in self.fields:
                self.peaks[key] = max(self.peaks.get(key, 0), value)

    def _run(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.sample()
