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


def test_a_batch_of_joint_moments_takes_what_the_memory_model_counts():
    """A batch's joint moment is its float32 product and float64 copy, added once to the running sums: the memory
    model's `one batch's sums` (it used to count the copy twice, over-predicting the lean recipe by a quarter)."""
    from transformers import LlamaConfig

    from pruner.core.arch import geometry
    from pruner.runs.calibration_memory import _running_bytes, meta_model
    from pruner.runs.resources import Sizes

    model = meta_model(LlamaConfig(num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                                   hidden_size=2048, intermediate_size=64, vocab_size=64))
    assert geometry(model).n_heads * geometry(model).head_dim == 2048
    batch = _running_bytes(model, Sizes(batch_size=1, length=256, pair_metrics=0, joint=True))[1] / 2**20
    measured = peak_mib("moments", 256)
    print(f"a batch's joint moments: measured {measured:.1f} MiB, the memory model {batch:.1f} MiB")
    assert 0.9 * batch <= measured <= 1.2 * batch


@pytest.mark.slow  # three processes at T=1024; the memory model's count is checked above
def test_capture_peak_memory_far_below_eager_at_1024():
    plain, capture, eager = (peak_mib(m, 1024) for m in ("plain", "capture", "eager"))
    print(f"peak growth MiB at T=1024: plain {plain:.0f}, capture {capture:.0f}, eager maps {eager:.0f}")
    # eager stores 4 layers x 8 heads x 1024 x 1024 maps (128 MiB in float32) and works on them
    assert eager > 128
    assert capture - plain < (eager - plain) / 4
