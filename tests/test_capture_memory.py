"""Capture never materialises layers x heads x T x T: its peak memory stays far below eager maps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
PROBE = Path(__file__).with_name("mem_probe.py")


def peak_mib(mode: str, T: int) -> float:
    out = subprocess.run([sys.executable, str(PROBE), mode, str(T)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_capture_peak_memory_far_below_eager_at_1024():
    plain, capture, eager = (peak_mib(m, 1024) for m in ("plain", "capture", "eager"))
    print(f"peak growth MiB at T=1024: plain {plain:.0f}, capture {capture:.0f}, eager maps {eager:.0f}")
    # eager stores 4 layers x 8 heads x 1024 x 1024 maps (128 MiB in float32) and works on them
    assert eager > 128
    assert capture - plain < (eager - plain) / 4
