"""Resources before compute: the memory estimate's parts, refusals with the estimate and what would fit."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from pruner.core.runtime import model_bytes
from pruner.runs import resources
from pruner.runs.resources import Sizes

pytestmark = pytest.mark.integration


def test_estimate_grows_with_what_is_asked():
    model = tiny_model("llama")
    small = resources.calibration_estimate(model, Sizes(batch_size=2, length=64))
    assert set(small.parts) == {"model", "statistics", "activations", "capture"}
    assert small.parts["model"] == model_bytes(model) > 0
    bigger = resources.calibration_estimate(model, Sizes(batch_size=8, length=64))
    assert bigger.parts["activations"] == 4 * small.parts["activations"]  # linear in the batch
    longer = resources.calibration_estimate(model, Sizes(batch_size=2, length=128))
    assert longer.parts["capture"] > 2 * small.parts["capture"]  # chunk x keys: more than linear in T
    no_moments = resources.calibration_estimate(model, Sizes(batch_size=2, length=64, outputs=False))
    assert no_moments.parts["statistics"] < small.parts["statistics"]
    grad = resources.calibration_estimate(model, Sizes(batch_size=1, length=128, gradient=True))
    assert "gradient pass" in grad.parts or grad.parts["activations"] > 0
    assert small.text().startswith("model ") and small.text().endswith(resources.gib(small.total))


def test_too_little_memory_is_refused_with_what_would_fit(monkeypatch):
    model = tiny_model("gpt2")
    sizes = Sizes(batch_size=64, length=128)
    est = resources.calibration_estimate(model, sizes)
    room = resources.calibration_estimate(model, Sizes(batch_size=8, length=128)).total - est.parts["model"]
    monkeypatch.setattr(resources, "available_memory", lambda device: room)
    with pytest.raises(resources.ResourceError, match=r"^not enough memory for calibration: its peak is about "
                       r"[\d.]+ \w+ \(model .* = [\d.]+ \w+\), and only [\d.]+ \w+ is free on cpu beyond the loaded "
                       r"model; lower calibration.batch_size: 8 \(about [\d.]+ \w+\) or model.dtype: bfloat16"):
        resources.check_memory(model, sizes)
    assert resources.check_memory(model, Sizes(batch_size=8, length=128)).total == room + est.parts["model"]
    monkeypatch.setattr(resources, "available_memory", lambda device: None)  # unknown: not checked
    assert resources.check_memory(model, sizes) == est


@pytest.mark.unit
def test_available_memory_is_positive_on_this_machine():
    free = resources.available_memory("cpu")
    assert free is None or free > 0


@pytest.mark.unit
def test_too_little_disk_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "free_disk", lambda folder: 100 << 20)
    with pytest.raises(resources.ResourceError, match=r"^not enough disk space in .*: the pruned checkpoint "
                                                      r"needs about 2.0 GiB, and 100 MiB is free there; free some "
                                                      r"space or choose another --out"):
        resources.check_disk(tmp_path / "run", 2 << 30, "the pruned checkpoint")
    resources.check_disk(tmp_path / "run", 50 << 20, "the pruned checkpoint")
    assert resources.free_disk(tmp_path / "not" / "yet") > 0  # the nearest existing parent
