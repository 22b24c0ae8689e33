"""The recovery's memory check: the method decided and its peak checked before the teacher samples a token.

`recovery.method` unset trains every weight (`full`) where the student, its training state and
the teacher fit the free memory, and LoRA's adapters otherwise, saying so in one line. A method
that does not fit -- chosen so, or neither -- is refused in one line with the estimate and the
settings that would fit (`pruner.recovery.memory` says what is counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from pruner.core import distributed
from pruner.core.runtime import input_device
from pruner.recovery import memory
from pruner.recovery.spec import RecoverySpec
from pruner.runs.resources import Estimate, ResourceError, available_memory, gib, sharing


def estimate(student, teacher, spec: RecoverySpec, method: str, teacher_held: bool,
             teacher_bytes: int | None = None) -> Estimate:
    """The peak of one process's training step (`pruner.recovery.memory.estimate`) as an `Estimate`."""
    cpu = input_device(student).type == "cpu"
    return Estimate(memory.estimate(student, teacher, spec, method, teacher_held=teacher_held,
                                    processes=distributed.world_size(), cpu=cpu, teacher_bytes=teacher_bytes))


@dataclass(frozen=True)
class Room:
    """What a training step has to fit in: `held` bytes already loaded (student and teacher), `free` bytes free on
    the student's device beyond them (None: unknown, anything fits), shared by `procs` processes."""

    held: int
    free: int | None
    procs: int

    def fits(self, est: Estimate) -> bool:
        return self.free is None or self.procs * (est.total - self.held) <= self.free


def _room(student, held: int) -> Room:
    device = input_device(student)
    return Room(held, available_memory(device), sharing(device))


def _hints(student, teacher, spec: RecoverySpec, method: str, teacher_held: bool, teacher_bytes,
           room: Room) -> list[str]:
    """Settings that would fit (at most three)."""
    tries = []
    if method != "lora":
        tries.append(("recovery.method: lora", spec, "lora", teacher_held))
    if spec.teacher == "resident":
        tries.append(("recovery.teacher: cached", spec.model_copy(update={"teacher": "cached"}), method, False))
    b = spec.batch_size // 2
    while b >= 1:
        tries.append((f"recovery.batch_size: {b}", spec.model_copy(update={"batch_size": b}), method, teacher_held))
        b //= 2
    out = []
    for text, s, m, h in tries:
        e = estimate(student, teacher, s, m, h, teacher_bytes)
        if room.fits(e):
            out.append(f"{text} (about {gib(e.total)})")
            if text.startswith("recovery.batch_size") or len(out) == 3:
                break
    return out


def choose(student, teacher, spec: RecoverySpec, *, teacher_held: bool, teacher_bytes: int | None = None
           ) -> tuple[RecoverySpec, Estimate, str | None]:
    """`spec` with its method decided and checked against the free memory, the method's estimate, and a one-line
    note when the default fell back to LoRA (else None). `teacher_held`: whether the teacher's weights stay in
    memory while the student trains. Raises `ResourceError` when the method does not fit."""
    room = _room(student, memory.held_now(student, teacher, teacher_bytes))
    held, free, procs = room.held, room.free, room.procs
    method = spec.method or "full"
    est = estimate(student, teacher, spec, method, teacher_held, teacher_bytes)
    if room.fits(est):
        return spec.model_copy(update={"method": method}), est, None
    if spec.method is None:
        lora = estimate(student, teacher, spec, "lora", teacher_held, teacher_bytes)
        if room.fits(lora):
            note = (f"recovery: training every weight needs about {gib(est.total)} and {gib(free // procs)} is free "
                    f"beyond the loaded models: training LoRA adapters instead (recovery.method: lora, about "
                    f"{gib(lora.total)})")
            return spec.model_copy(update={"method": "lora"}), lora, note
    hints = _hints(student, teacher, spec, method, teacher_held, teacher_bytes, room)
    device = input_device(student)
    more = " or recovery.fsdp: true over several processes" if device.type == "cuda" and not spec.fsdp else ""
    raise ResourceError(
        f"not enough memory for recovery ({method}): a training step's peak is about {gib(est.total)} "
        f"({est.text()}), and only {gib(free // procs)} is free on {device} beyond the loaded models "
        f"({gib(held)}); set " + (", or ".join(hints) if hints else "a smaller recovery.batch_size") + more)

