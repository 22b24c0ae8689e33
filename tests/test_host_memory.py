"""Freed host memory goes back to the system between blocks (pruner.core.host_memory)."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

GLIBC = pytest.mark.skipif(not Path("/proc/self/status").exists() or platform.libc_ver()[0] != "glibc",
                           reason="glibc's allocator, and RssAnon read from Linux's /proc")

ANON = """
from pruner.core.proc_status import status
def anon():
    return status()["RssAnon"]
"""

SCRIPT = ANON + """
from pruner.core.host_memory import release_freed
bufs = [bytearray(100_000) for _ in range(2000)]  # 200 MB below the mmap threshold: the heap's
pin = bytearray(100_000)  # above them: the heap's top stays in use, so free() alone gives nothing back
del bufs
before = anon()
released = release_freed()
print(before, anon(), released)
"""


@GLIBC
def test_freed_heap_pages_are_returned():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    before, after, released = int(out[0]), int(out[1]), out[2] == "True"
    assert released
    assert before - after > 150e6  # most of the 200 MB freed inside the heap left the process


LARGE = ANON + """
from pruner.core.host_memory import map_large_buffers
big = bytearray(16 * 2**20); del big  # a 16 MiB buffer freed: glibc raises its mmap threshold to 16 MiB
if {set}:
    assert map_large_buffers()
bufs = [bytearray(8 * 2**20) for _ in range(25)]  # 200 MiB of 8 MiB buffers (below glibc's 32 MiB ceiling)
pin = bytearray(100_000)  # a small allocation after them: on the heap's top when they are there
before = anon()
del bufs
print(before, anon())
"""


@GLIBC
def test_large_buffers_leave_the_process_when_freed():
    """With map_large_buffers, 8 MiB buffers are mapped on their own: freed, they leave at once (no trim)."""
    def freed(set_it: bool) -> int:
        out = subprocess.run([sys.executable, "-c", LARGE.format(set=set_it)], capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]) - int(out[1])
    assert freed(False) < 50 * 2**20  # without it they stay on the heap, under the pin: nothing leaves
    assert freed(True) > 180 * 2**20


REUSE = """
import resource
from pruner.core.host_memory import reuse_buffers
if {set}:
    assert reuse_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = bytearray(64 * 2**20); del a  # a training step's large buffer, freed
before = faults()
a = bytearray(64 * 2**20)  # and the next step's
print(faults() - before)
"""


@GLIBC
def test_reused_buffers_fault_no_fresh_pages():
    """With reuse_buffers, a step's 64 MiB buffer is the last step's memory again: no fresh pages to fault in."""
    def faults(set_it: bool) -> int:
        return int(subprocess.run([sys.executable, "-c", REUSE.format(set=set_it)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])
    assert faults(False) > 10_000  # mapped afresh: 16,384 pages of 4 KiB
    assert faults(True) < 1_000


@GLIBC
def test_glibc_can_release_and_the_timing_peak_sees_live_memory():
    """The bench's CPU peak (`timing._Peak`) is measured where the free heap can be returned first."""
    import torch

    from pruner.core.host_memory import can_release
    from pruner.evaluation.timing import _Peak

    assert can_release()
    with _Peak(torch.device("cpu")) as peak:
        x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        del x
    assert peak.growth is not None and 60 << 20 < peak.growth < 200 << 20
