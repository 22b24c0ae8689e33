"""Output folders that are never half-written: filled as `.NAME.partial`, renamed into place when complete,
locked against a second live run, kept for `--resume` when they hold checkpoints."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pruner.core import resume

LOCK = ".lock"


def partial_dir(out: Path) -> Path:
    """Where a run is written until it is complete: `.NAME.partial` next to `out` (what --resume continues)."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


class DiskFullError(OSError):
    """The disk filled up while writing; nothing was left behind."""


def disk_full(e: BaseException | None) -> bool:
    """Whether `e` (or what caused it) is a full disk: ENOSPC/EDQUOT, also as wrapped by safetensors or torch."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in ("No space left on device", "os error 28", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _lock(folder: Path, out: Path) -> int:
    """Hold an exclusive lock on `out`'s partial `folder` (the kernel releases it, even on SIGKILL)."""
    fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise resume.ResumeError(f"another pruner run is writing {out} right now "
                                 f"(its partial folder {folder} is locked); wait for it or choose another --out") \
            from None
    return fd


def _clear(folder: Path, keep_state: bool) -> None:
    """Empty `folder` but for its lock (and, when resuming, its checkpoints)."""
    for f in folder.iterdir():
        if f.name == LOCK or (keep_state and f.name == resume.STATE):
            continue
        shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()


@contextmanager
def atomic_dir(out: Path, overwrite: bool, resume_run: bool = False) -> Iterator[Path]:
    """`with atomic_dir(out, overwrite) as tmp:` fill `tmp` = `.NAME.partial` next to `out`; it is
    renamed to `out` when the block ends normally. Existing or unwritable destinations fail on
    entry, before any compute, and so does a partial folder another live run holds (a lock).

    When the block raises, `tmp` is removed -- unless it holds checkpoints (`pruner.core.resume`):
    then it is kept for `--resume` (the exception gets `pruner_partial = tmp`), whatever the
    error, Ctrl-C included, so the visible `out` is never half-written and no finished work is
    lost. A full disk always removes it (that frees the space) and says so. A SIGKILL leaves
    `tmp` as it was; the next run with `resume_run` keeps its checkpoints (whether they fit
    is `resume.open_checkpoints`'s to say), and a run without it refuses to discard them
    unless `overwrite`.
    """
    out = Path(out)
    tmp = partial_dir(out)
    fd = _open_partial(out, tmp, overwrite, resume_run)
    resuming = resume_run and resume.has_state(tmp)
    if resume.has_state(tmp) and not resuming and not overwrite:
        os.close(fd)
        raise resume.ResumeError(f"an interrupted run of {out} is kept in {tmp}: pass --resume to continue it, "
                                 "or --overwrite to start over")
    _clear(tmp, keep_state=resuming)
    try:
        yield tmp
    except BaseException as e:
        full = disk_full(e)
        if full or not resume.has_state(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            e.pruner_partial = tmp
        os.close(fd)
        if full:
            raise DiskFullError(f"no space left on device while writing {out}: nothing was written and the partial "
                                f"folder was removed; free space on {out.parent} and run again") from None
        raise
    try:
        _publish(tmp, out)
    finally:
        os.close(fd)


def _open_partial(out: Path, tmp: Path, overwrite: bool, resume_run: bool) -> int:
    """Refuse a complete `out` (unless `overwrite`) or an unwritable parent; create and lock the partial `tmp`.
    Returns the lock's file descriptor."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        if resume_run and not resume.has_state(tmp):
            raise FileExistsError(f"{out} is already complete: nothing to resume")
        raise FileExistsError(f"output folder {out} exists and is not empty; pass --overwrite to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(13, "permission denied")
        tmp.mkdir(exist_ok=True)
        return _lock(tmp, out)
    except OSError as e:
        raise PermissionError(f"cannot write the output folder {out}: {e.strerror or e}") from None


def _publish(tmp: Path, out: Path) -> None:
    """The finished partial folder, without its checkpoints and lock, renamed to `out` (replacing it)."""
    shutil.rmtree(tmp / resume.STATE, ignore_errors=True)
    (tmp / LOCK).unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
