"""Resumable runs: checkpointed sums resume to the bits of an uninterrupted run; the partial folder's life.

In-process tests interrupt a stage with an exception at an exact batch (the
kill point's hook); `test_resume_cli.py` kills whole `pruner` processes with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import errno
import json

import pytest
import torch
from tiny import ragged_batch, tiny_model

from pruner.attention import moments, sums
from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core import outputs, resume
from pruner.core.data import pad
from pruner.pruning.calibrate import CalibrationOptions, calibrate

pytestmark = pytest.mark.integration


class Killed(Exception):
    """Stands in for SIGKILL at a kill point (in-process)."""


@pytest.fixture
def kill_at(monkeypatch):
    """`kill_at("capture:2")` makes that kill point raise `Killed` instead of killing the test process."""
    def arm(label: str) -> None:
        def point(name: str) -> None:
            if name == label:
                raise Killed(name)
        monkeypatch.setattr(resume, "kill_point", point)
    return arm


def tensors(x, prefix=""):
    """Every tensor of a (nested) dataclass / dict / list, by path."""
    if dataclasses.is_dataclass(x):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k2: v2 for k, v in x.items() for k2, v2 in tensors(v, f"{prefix}{k}.").items()}
    if isinstance(x, (list, tuple)):
        return {k2: v2 for i, v in enumerate(x) for k2, v2 in tensors(v, f"{prefix}{i}.").items()}
    return {prefix: x} if isinstance(x, torch.Tensor) else {}


def assert_identical(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k  # bit for bit, not merely close


@pytest.mark.unit
def test_plain_round_trip_of_layer_stats(tmp_path):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.rand(*s, generator=g, dtype=torch.float64)

    om = moments.OutputMoments(r(()), r(2, 3), r(2, 3), r(2, 3), r(2, 3, 3), r(2, 3, 3), r(2, 3, 3), r(6, 6))
    ls = sums.LayerStats(*(r(()) if i < 2 else r(2) for i in range(9)), pairs={"cosine/full": r(2, 2)}, outputs=om)
    ck = resume.Checkpoints(tmp_path, every_batches=1)
    ck.save("x", {"layers": resume.plain({0: ls, 3: ls}), "cursor": 7})
    back = ck.load("x")
    layers = resume.unplain(back["layers"], {"LayerStats": sums.LayerStats, "OutputMoments": moments.OutputMoments})
    assert back["cursor"] == 7 and set(layers) == {0, 3}
    assert_identical(layers[3], ls)
    assert not list(tmp_path.rglob("*.tmp"))  # written through a temporary file, then renamed


@pytest.mark.unit
def test_checkpoints_restore_the_rng_state(tmp_path):
    ck = resume.Checkpoints(tmp_path, every_batches=1)
    torch.manual_seed(5)
    ck.step("s", 1, lambda: {"cursor": 1})
    expected = torch.rand(3)
    torch.manual_seed(99)
    ck.load("s")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.unit
def test_a_finished_stage_waits_for_the_next_save(tmp_path):
    ck = resume.Checkpoints(tmp_path, every_batches=None, every_seconds=3600)
    ck.finish("capture", lambda: {"cursor": 4})
    assert ck.load("capture") is None and not resume.has_state(tmp_path)
    ck.save("gradient", {"cursor": 1})  # a later save writes the earlier finished stage first
    assert ck.load("capture")["cursor"] == 4 and ck.load("gradient")["cursor"] == 1


CAL_CONFIG = CaptureConfig(chunk_size=4, metrics=("cosine", "js"), outputs=True)


def _calibrate(family, checkpoints):
    batch = pad(ragged_batch(seed=3, n=7), 0)  # 4 batches of 2: the last one short
    return calibrate(tiny_model(family), batch, SinkSpec("first"), config=CAL_CONFIG,
                     options=CalibrationOptions(gradient=True, batch_size=2, checkpoints=checkpoints))


@pytest.fixture(scope="module")
def uninterrupted():
    return {family: _calibrate(family, resume.NONE) for family in ("gpt2", "llama")}


@pytest.mark.parametrize("family,kill", [("gpt2", "capture:1"), ("gpt2", "gradient:2"), ("gpt2", "capture:done"),
                                         ("llama", "capture:3"), ("llama", "gradient:done")])
def test_resumed_calibration_is_bit_identical(tmp_path, kill_at, uninterrupted, family, kill):
    want = uninterrupted[family]
    kill_at(kill)
    with pytest.raises(Killed):
        _calibrate(family, resume.Checkpoints(tmp_path, every_batches=1))
    assert resume.has_state(tmp_path)
    kill_at("never")
    got = _calibrate(family, resume.Checkpoints(tmp_path, every_batches=1))
    assert_identical(got.stats, want.stats)
    assert torch.equal(got.gradient, want.gradient) and torch.equal(got.cross, want.cross)


def test_resumed_model_wide_capture_is_bit_identical(tmp_path, kill_at):
    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=1, n=5), 0)
    cfg = CaptureConfig(chunk_size=4, metrics=("cosine",), across_layers=True)
    want = capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=2)
    kill_at("capture:2")
    with pytest.raises(Killed):
        capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=2,
                      checkpoints=resume.Checkpoints(tmp_path, every_batches=1))
    kill_at("never")
    got = capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=2,
                        checkpoints=resume.Checkpoints(tmp_path, every_batches=1))
    assert_identical(got, want)


# --- the partial folder ----------------------------------------------------------------------------


def test_partial_folder_is_deterministic_and_renamed(tmp_path):
    out = tmp_path / "run"
    with outputs.atomic_dir(out, overwrite=False) as tmp:
        assert tmp == tmp_path / ".run.partial"
        (tmp / "plan.json").write_text("{}")
    assert (out / "plan.json").exists() and not (tmp_path / ".run.partial").exists()
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]  # no lock, no state


def test_checkpoints_survive_an_error_and_resume_checks_the_fingerprint(tmp_path):
    out, fp = tmp_path / "run", {"recipe": {"selection": {"target": 0.25}}}
    with pytest.raises(KeyboardInterrupt) as info:
        with outputs.atomic_dir(out, False) as tmp:
            resume.open_checkpoints(tmp, fp, every_batches=1).step("capture", 1, lambda: {"cursor": 1})
            (tmp / "plan.json").write_text("half")
            raise KeyboardInterrupt
    assert info.value.pruner_partial == tmp and resume.has_state(tmp) and not out.exists()
    with pytest.raises(resume.ResumeError, match=r"an interrupted run of .*run is kept in .*\.run\.partial: "
                                                 r"pass --resume to continue it, or --overwrite to start over"):
        with outputs.atomic_dir(out, False):
            pass
    other = {"recipe": {"selection": {"target": 0.4}}}
    with pytest.raises(resume.ResumeError, match=r"cannot resume from .*\.run\.partial: the interrupted run had a "
                                                 r"different setup \(recipe.selection.target: 0.25 -> 0.4\)"):
        with outputs.atomic_dir(out, False, resume_run=True) as tmp:
            resume.open_checkpoints(tmp, other)
    assert resume.has_state(tmp)  # a refused resume keeps the checkpoints
    with outputs.atomic_dir(out, False, resume_run=True) as again:
        assert again == tmp and resume.open_checkpoints(tmp, fp).load("capture")["cursor"] == 1
        assert not (tmp / "plan.json").exists()  # half-written files of the killed run are gone
        (tmp / "plan.json").write_text("whole")
    assert (out / "plan.json").read_text() == "whole" and not (out / resume.STATE).exists()
    with outputs.atomic_dir(out, True) as tmp:  # a fresh run starts without the old fingerprint
        assert resume.open_checkpoints(tmp, other).load("capture") is None


def test_errors_without_checkpoints_leave_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError):
        with outputs.atomic_dir(out, False) as tmp:
            (tmp / "x").write_text("x")
            raise ValueError("bad")
    assert not list(tmp_path.iterdir())


def test_resume_of_a_complete_run_says_so(tmp_path):
    out = tmp_path / "run"
    with outputs.atomic_dir(out, False) as tmp:
        (tmp / "plan.json").write_text("{}")
    with pytest.raises(FileExistsError, match="run is already complete: nothing to resume"):
        with outputs.atomic_dir(out, False, resume_run=True):
            pass


def test_a_live_run_holds_its_partial_folder(tmp_path):
    out = tmp_path / "run"
    with outputs.atomic_dir(out, False):
        with pytest.raises(resume.ResumeError, match="another pruner run is writing .*run right now"):
            with outputs.atomic_dir(out, True):
                pass


@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_full_disk_leaves_no_partial_folder(tmp_path, how):
    out = tmp_path / "run"
    with pytest.raises(outputs.DiskFullError, match=r"^no space left on device while writing .*run: nothing was "
                                                   r"written and the partial folder was removed"):
        with outputs.atomic_dir(out, False) as tmp:
            resume.Checkpoints(tmp, every_batches=1).step("capture", 1, lambda: {"cursor": 1})
            if how == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                               "\"No space left on device\" })")
    assert not list(tmp_path.iterdir())


def test_fingerprint_differences_are_named():
    a = resume.fingerprint("prune", {"threads": 2, "seed": 0, "model": {"path": "x"}}, {}, {"model": "sha:1"})
    b = resume.fingerprint("prune", {"threads": 1, "seed": 0, "model": {"path": "x"}}, {}, {"model": "sha:2"})
    assert resume.differences(a, b) == ["identity.model: sha:1 -> sha:2"]  # threads may change
    assert json.loads(json.dumps(a)) == a
    assert resume.differences({"a": list(range(30))}, {"a": []}) == ["a: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11... -> []"]


def test_ctrl_c_during_a_checkpoint_write_lands_after_it(tmp_path, monkeypatch):
    """A SIGINT that arrives inside the write is held, not lost: the file is complete and the interrupt
    is raised once the write returns (inside torch.save it would surface as a zip-writer error)."""
    import os
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, whatever we inherited
    real_save = torch.save

    def save_interrupted(obj, f):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C mid-write
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_interrupted)
    ckpt = resume.Checkpoints(tmp_path, every_batches=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.save("stage", {"cursor": 3, "x": torch.arange(4)})
    finally:
        signal.signal(signal.SIGINT, previous)
    state = resume.Checkpoints(tmp_path).load("stage")  # the write completed, atomically
    assert state["cursor"] == 3 and torch.equal(state["x"], torch.arange(4))
