"""Resumable runs: the mergeable sums of a long run, saved now and then into its partial folder.

Every expensive stage of a run is either a sum over samples added in a fixed
order (capture statistics, residual norms, gradient importances) or a list of
finished results (the base model's NLLs, each plan's evaluation). A checkpoint
after batch k holds the float64 sums of batches 0..k-1 exactly, with the cursor k
and the RNG state; a resumed run loads it and adds batches k.. in the same order,
so it ends with the bits an uninterrupted run ends with (same plan.json byte for
byte, same metrics).

Checkpoints live in `state/rank-R/NAME.pt` inside the run's partial folder
(`report.atomic_dir`), one file per stage, each replaced atomically (write, fsync,
rename): a SIGKILL at any instant leaves the previous checkpoint whole. With
several processes every rank keeps its own shard's sums and cursor. Files are
read back with `torch.load(weights_only=True)`: tensors and plain Python values
only, never arbitrary pickled objects.

A run resumes only with the setup it was started with: `state/fingerprint.json`
records the command, its options, the resolved recipe (less what cannot change a
result: threads and checkpoint cadence), the number of processes and the
identities of the base model, tokenizer and data (`pruner.runs.provenance`); any
difference is refused, naming it.

`PRUNER_TEST_KILL_AT=capture:3` (tests only) makes the process SIGKILL itself
right after batch 3 of the stage `capture` (`capture:3@1`: only rank 1), so a
test can interrupt a run at an exact point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from pruner.core import distributed

STATE = "state"
FINGERPRINT = "fingerprint.json"
KILL_ENV = "PRUNER_TEST_KILL_AT"
VOLATILE_RECIPE_KEYS = ("threads", "checkpoint")  # may change between the interrupted and the resumed run
# (and capture.memory_check)


class ResumeError(ValueError):
    """A run that cannot be resumed as asked; the message says why and what to do."""


def kill_point(label: str) -> None:
    """SIGKILL this process when `label` (e.g. `capture:3`) is named in PRUNER_TEST_KILL_AT (tests only)."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    for item in wanted.split(","):
        point, _, rank = item.strip().partition("@")
        if point == label and (not rank or int(rank) == distributed.rank()):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def has_state(folder: Path) -> bool:
    """Whether a partial folder holds checkpoints a resumed run could use."""
    return any((Path(folder) / STATE).glob("rank-*/*.pt"))


class Checkpoints:
    """Checkpoints of one run in `folder` (its partial folder); with `folder=None` nothing is saved.

    A stage calls `load(name)` once (None: start from the beginning), `step(name,
    k, state_fn)` after each batch (saves when due: every `every_batches` batches
    or `every_seconds` since the last save), and `finish(name, state_fn)` at its end.
    A finished stage is written with the next save (or at once when one is due),
    so a later checkpoint never exists without the earlier stages' results.
    """

    def __init__(self, folder: Path | None = None, every_batches: int | None = None,
                 every_seconds: float | None = 600.0):
        self.folder = None if folder is None else Path(folder)
        self.every_batches, self.every_seconds = every_batches, every_seconds
        self._last = time.monotonic()
        self._pending: dict[str, dict] = {}

    @property
    def active(self) -> bool:
        return self.folder is not None

    def _path(self, name: str) -> Path:
        return self.folder / STATE / f"rank-{distributed.rank()}" / (name.replace("/", "__") + ".pt")

    def load(self, name: str) -> dict | None:
        """This rank's saved state of stage `name`, or None. Restores the RNG state saved with it."""
        if not self.active or not self._path(name).exists():
            return None
        state = torch.load(self._path(name), map_location="cpu", weights_only=True)
        torch.set_rng_state(state.pop("__rng__"))
        return state

    def load_all(self, name: str) -> dict | None:
        """`load`, but None unless every process has the stage (stages that end in a collective)."""
        state = self.load(name)
        return state if all(distributed.all_objects(state is not None)) else None

    def due(self, batches_done: int) -> bool:
        if not self.active:
            return False
        if self.every_batches and batches_done % self.every_batches == 0:
            return True
        return self.every_seconds is not None and time.monotonic() - self._last >= self.every_seconds

    def save(self, name: str, state: dict) -> None:
        """Write `state` (tensors and plain values) for this rank, atomically, with the RNG state."""
        for pending, s in list(self._pending.items()):
            self._write(pending, s)
            del self._pending[pending]
        self._write(name, {**state, "__rng__": torch.get_rng_state()})
        self._last = time.monotonic()

    def _write(self, name: str, state: dict) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with _signals_held():  # Ctrl-C inside torch.save would surface as a zip-writer error, not an interrupt
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def step(self, name: str, batches_done: int, state_fn) -> None:
        """After a batch: save `state_fn()` when due. Also the tests' kill point `name:batches_done`."""
        if self.due(batches_done):
            self.save(name, state_fn())
        kill_point(f"{name}:{batches_done}")

    def finish(self, name: str, state_fn) -> None:
        """A stage is complete: its state, `state_fn()`, is saved now if a save is due, else with the
        next save (held in memory until then)."""
        if not self.active:
            return
        if self.every_batches or (self.every_seconds is not None
                                  and time.monotonic() - self._last >= self.every_seconds):
            self.save(name, state_fn())
        else:  # the RNG state as it is now, at the end of the stage
            self._pending[name] = {**state_fn(), "__rng__": torch.get_rng_state()}
        kill_point(f"{name}:done")


NONE = Checkpoints()


# --- stage state as plain values ----------------------------------------------------------------


def plain(x):
    """Dataclasses (nested), dicts, lists and tensors -> values `torch.load(weights_only=True)` reads back."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__dataclass__": type(x).__name__,
                **{f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return x


def unplain(x, types: dict[str, type]):
    """The inverse of `plain`, given the dataclasses it may meet by name."""
    if isinstance(x, dict):
        if "__dataclass__" in x:
            cls = types[x["__dataclass__"]]
            return cls(**{k: unplain(v, types) for k, v in x.items() if k != "__dataclass__"})
        return {k: unplain(v, types) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(unplain(v, types) for v in x)
    return x


# --- fingerprints ----------------------------------------------------------------------------------


def fingerprint(command: str, recipe: dict | None, options: dict, identity: dict) -> dict:
    """What a resumed run must share with the interrupted one (JSON-able)."""
    from pruner.core.version import __version__

    recipe = {k: v for k, v in (recipe or {}).items() if k not in VOLATILE_RECIPE_KEYS}
    if isinstance(recipe.get("capture"), dict):  # the memory check changes no result
        recipe["capture"] = {k: v for k, v in recipe["capture"].items() if k != "memory_check"}
    return json.loads(json.dumps({"command": command, "pruner_version": __version__,
                                  "processes": distributed.world_size(), "options": options, "recipe": recipe,
                                  "identity": identity}, default=str))


def _flat(x, prefix: str = "") -> dict[str, object]:
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out if out else {prefix.rstrip("."): "{}"}
    return {prefix.rstrip("."): x}


def differences(old: dict, new: dict, limit: int = 3) -> list[str]:
    """`key: old -> new` for each dotted key that differs (at most `limit`, then a count)."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k, "(none)") != b.get(k, "(none)")]

    def short(v):
        s = v if isinstance(v, str) else json.dumps(v)
        return s if len(s) <= 40 else s[:37] + "..."

    out = [f"{k}: {short(a.get(k, '(none)'))} -> {short(b.get(k, '(none)'))}" for k in keys[:limit]]
    return out + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def open_checkpoints(folder: Path, fp: dict, every_batches: int | None = None,
                     every_seconds: float | None = 600.0) -> Checkpoints:
    """The checkpoints of a run in `folder`: those already there if they were made with the same setup
    (`fp`, see `fingerprint`), none otherwise. A different setup is refused, naming what differs.

    With several processes rank 0 checks and every process learns the outcome.
    """
    folder = Path(folder)
    path = folder / STATE / FINGERPRINT
    error = None
    if distributed.is_main():
        if has_state(folder):
            old = json.loads(path.read_text()) if path.exists() else {}
            diff = differences(old, fp)
            if diff:
                error = (f"cannot resume from {folder}: the interrupted run had a different setup "
                         f"({'; '.join(diff)}); rerun its own command with --resume, or start over with --overwrite")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")
    error = distributed.all_objects(error)[0]
    if error:
        raise ResumeError(error)
    return Checkpoints(folder, every_batches, every_seconds)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C (SIGINT) inside the block is recorded, and delivered to the previous handler when the block
    ends: an interrupt lands between checkpoint writes, never inside one (inside torch.save it would
    surface as the zip writer's RuntimeError, and leave a half-written temporary file).

    A Python-level handler, not a signal mask: Python runs signal handlers in the main thread between
    bytecodes, whichever thread the OS delivers the signal to, while a mask is per thread and the
    signal would reach one of torch's worker threads. Main thread only (signal.signal requires it); an
    ignored SIGINT stays ignored.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    caught: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])  # the default handler raises KeyboardInterrupt here
