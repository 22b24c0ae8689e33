"""Kill a `pruner` run with SIGKILL, resume it with --resume: the same plan.json, byte for byte, and the
same metrics (to 1e-12) as the run that was never interrupted.

Deterministic kill points: PRUNER_TEST_KILL_AT=STAGE:K makes the process SIGKILL itself right after
batch K of a stage (`capture`, `gradient`), when a stage is done (`base:done`, `evaluation:done`,
`compare-1:done`) or once the run's files are written but before its folder is renamed (`save`);
`@R` kills rank R only. One more case kills from outside, the moment the first checkpoint appears. Checkpoints are saved
after every batch here (`checkpoint.every_batches=1`). Killed runs are subprocesses; reference and
resumed runs run in-process where one process suffices.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_reliability import _tiny, terminal_sigint

from pruner.cli import main
from pruner.core import resume

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["calibration.num_samples=6", "calibration.batch_size=2", "calibration.length=32", "evaluation.num_samples=4",
         "evaluation.length=32", "evaluation.batch_size=2", "evaluation.bootstrap=20", "evaluation.latency=false",
         "capture.metrics=[cosine]", "checkpoint.every_batches=1", "threads=1",
         "bench.enabled=false",  # timings differ run to run
         "selection.shape=any"]  # the tiny Llama at 25%: no servable shape
VOLATILE = ("seconds", "latency_ms_before", "latency_ms_after")
RESULTS: list[dict] = []  # what each case found, printed at the end (pytest -s) for the report


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume-models")
    gpt2 = _tiny(d / "gpt2", "gpt2", n_layer=2, n_head=4, n_embd=32, n_positions=64, bos_token_id=1, eos_token_id=2)
    llama = _tiny(d / "llama", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2)
    for name, folder in (("gpt2", gpt2), ("llama", llama)):
        (d / f"{name}.yaml").write_text(f"model: {{path: {folder}}}\nsinks: {{mode: first}}\n")
    return d


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def argv(models: Path, family: str, out: Path, command: str = "prune", extra=()) -> list[str]:
    sets = [x for s in QUICK + list(extra) for x in ("--set", s)]
    tail = ["--scorers", "sink-aware,gradient", "--sparsities", "0.25,0.5"] if command == "compare" else []
    return [command, str(models / f"{family}.yaml"), "--out", str(out), *sets, *tail]


def in_process(args: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    assert rc == 0, err.getvalue()[-2000:]


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def killed(args: list[str], kill_at: str, procs: int = 1) -> subprocess.CompletedProcess:
    """Run pruner in a subprocess (under torchrun for several processes) that SIGKILLs itself at `kill_at`."""
    cmd = [sys.executable, "-m", "pruner.cli", *args] if procs == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
         "-m", "pruner.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(**{resume.KILL_ENV: kill_at}), capture_output=True, text=True,
                          timeout=300)


def numbers(x, prefix=""):
    """Every number of a JSON value, by path (timings left out)."""
    if isinstance(x, dict):
        return {k2: v2 for k, v in x.items() if k not in VOLATILE for k2, v2 in numbers(v, f"{prefix}{k}.").items()}
    if isinstance(x, list):
        return {k2: v2 for i, v in enumerate(x) for k2, v2 in numbers(v, f"{prefix}{i}.").items()}
    return {prefix: x}


def compare_runs(a: Path, b: Path, files: tuple[str, ...], exact: tuple[str, ...]) -> float:
    """Assert `exact` files are byte-identical and the numbers of the JSON `files` agree to 1e-12;
    returns the largest difference."""
    for f in exact:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    worst = 0.0
    for f in files:
        na, nb = numbers(json.loads((a / f).read_text())), numbers(json.loads((b / f).read_text()))
        assert na.keys() == nb.keys(), f
        for k, v in na.items():
            if isinstance(v, float) and isinstance(nb[k], float):
                worst = max(worst, abs(v - nb[k]))
                assert nb[k] == pytest.approx(v, abs=1e-12, rel=0), (f, k)
            else:
                assert v == nb[k], (f, k)
    return worst


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """Uninterrupted runs, made once per family and command."""
    d, done = tmp_path_factory.mktemp("reference"), {}

    def get(family: str, command: str = "prune", extra=()) -> Path:
        key = (family, command, tuple(extra))
        if key not in done:
            out = d / f"{family}-{command}-{len(done)}"
            in_process(argv(models, family, out, command, extra))
            done[key] = out
        return done[key]
    return get


@pytest.mark.parametrize("family,command,kill_at,extra", [
    ("gpt2", "prune", "capture:1", ()),
    ("gpt2", "prune", "gradient:3", ("scorer.name=gradient",)),
    ("gpt2", "compare", "compare-1:done", ()),
    ("llama", "prune", "base:done", ()),
    ("llama", "prune", "evaluation:done", ("surgery.mode=remove",)),
    ("llama", "prune", "save", ()),
])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(models, reference, tmp_path, family, command, kill_at,
                                                             extra):
    out = tmp_path / "run"
    args = argv(models, family, out, command, extra)
    proc = killed(args, kill_at)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = tmp_path / ".run.partial"
    assert not out.exists() and resume.has_state(partial)
    in_process(args + ["--resume"])
    assert not partial.exists()
    files = ("plan.json", "metrics.json") if command == "prune" else ("compare.json",)
    worst = compare_runs(reference(family, command, extra), out, files,
                         exact=("plan.json",) if command == "prune" else ())
    RESULTS.append({"case": f"{family} {command} {' '.join(extra)} killed at {kill_at}", "largest_difference": worst})


def test_a_kill_from_outside_after_the_first_checkpoint_resumes(models, reference, tmp_path):
    """SIGKILL from outside (not at a kill point of the run's own): the moment the first checkpoint file
    appears the process is frozen (SIGSTOP), checked to be unfinished, and killed; the resumed run equals the
    uninterrupted one. At full speed the run still has ~1.4 s of work then (the rest of the capture, 12 gradient
    batches, both evaluations), against a 10 ms poll."""
    out = tmp_path / "run"
    extra = ("calibration.num_samples=12", "calibration.batch_size=1", "scorer.name=gradient")
    args = argv(models, "llama", out, extra=extra)
    partial = tmp_path / ".run.partial"
    first = partial / resume.STATE / "rank-0" / "capture.pt"
    proc = subprocess.Popen([sys.executable, "-m", "pruner.cli", *args], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    try:
        assert first.exists() and proc.poll() is None, f"no checkpoint before the run ended (exit {proc.returncode})"
        stages = sorted(p.stem for p in partial.glob("state/rank-0/*.pt"))
        assert not (partial / "metrics.json").exists() and not out.exists(), "the run finished before the kill"
    finally:
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not out.exists() and resume.has_state(partial)
    in_process(args + ["--resume"])
    assert not partial.exists()
    worst = compare_runs(reference("llama", extra=extra), out, ("plan.json", "metrics.json"), exact=("plan.json",))
    RESULTS.append({"case": f"llama prune gradient, SIGKILL from outside at the first checkpoint (saved stages "
                            f"{stages})", "largest_difference": worst})


@pytest.mark.xdist_group("torchrun")
@pytest.mark.slow  # three torchrun launches; one process killed and resumed is the default suite's (above)
def test_two_processes_killed_and_resumed(models, tmp_path):
    """torchrun, 2 processes: rank 1 kills itself mid-capture, torchrun ends rank 0; the resumed pair equals an
    uninterrupted pair."""
    def torchrun(args, **extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pruner.cli",
               *args]
        return subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=300)
    extra = ("scorer.name=gradient",)
    ref = torchrun(argv(models, "llama", tmp_path / "ref", extra=extra))
    assert ref.returncode == 0, ref.stderr[-2000:]
    args = argv(models, "llama", tmp_path / "run", extra=extra)
    proc = torchrun(args, **{resume.KILL_ENV: "gradient:1@1"})
    assert proc.returncode != 0 and not (tmp_path / "run").exists()
    partial = tmp_path / ".run.partial"
    assert list(partial.glob("state/rank-1/capture.pt")) and list(partial.glob("state/rank-0/*.pt"))
    done = torchrun(args + ["--resume"])
    assert done.returncode == 0, done.stderr[-2000:]
    worst = compare_runs(tmp_path / "ref", tmp_path / "run", ("plan.json", "metrics.json"), exact=("plan.json",))
    RESULTS.append({"case": "llama prune gradient, 2 processes, rank 1 killed at gradient:1", "largest_difference": worst})


def test_analyze_killed_and_resumed(models, tmp_path):
    args = ["analyze", str(models / "gpt2"), "--num-samples", "6", "--batch-size", "2", "--max-length", "32",
            "--threads", "1", "--checkpoint-batches", "1", "--metrics", "cosine,js"]
    in_process(args + ["--out", str(tmp_path / "ref")])
    proc = killed(args + ["--out", str(tmp_path / "run")], "capture:2")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    in_process(args + ["--out", str(tmp_path / "run"), "--resume"])
    worst = compare_runs(tmp_path / "ref", tmp_path / "run", ("analysis.json",), exact=("analysis.json",))
    RESULTS.append({"case": "gpt2 analyze killed at capture:2", "largest_difference": worst})


def test_resume_refuses_another_setup_and_ctrl_c_keeps_progress(models, tmp_path, capsys):
    out = tmp_path / "run"
    args = argv(models, "gpt2", out)
    assert killed(args, "capture:2").returncode == -signal.SIGKILL
    assert main(args) == 2  # no --resume: the checkpoints are not thrown away silently
    assert re.search(r"pruner: error: an interrupted run of .*run is kept in .*\.run\.partial: pass --resume to "
                     r"continue it, or --overwrite to start over", capsys.readouterr().err)
    assert main(args + ["--resume", "--set", "selection.target=0.5"]) == 2
    assert re.search(r"pruner: error: cannot resume from .*\.run\.partial: the interrupted run had a different setup "
                     r"\(recipe.selection.target: 0.25 -> 0.5\); rerun its own command with --resume, or start over "
                     r"with --overwrite$", capsys.readouterr().err.strip())
    assert resume.has_state(tmp_path / ".run.partial")


def test_ctrl_c_keeps_the_progress_and_says_how_to_resume(models, reference, tmp_path):
    out = tmp_path / "run"
    extra = ("calibration.num_samples=12", "calibration.batch_size=1")
    args = argv(models, "gpt2", out, extra=extra)
    partial = tmp_path / ".run.partial"
    log = tmp_path / "stderr.txt"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pruner.cli", *args], cwd=ROOT, env=env(), stderr=f,
                                stdout=subprocess.DEVNULL, preexec_fn=terminal_sigint)
        deadline = time.time() + 240
        while not resume.has_state(partial) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    last = log.read_text().strip().splitlines()[-1]
    assert rc == 130 and re.fullmatch(r"pruner: interrupted; no output folder was written; its progress is kept in "
                                      r".*\.run\.partial: run the same command with --resume to continue", last), last
    assert not out.exists() and resume.has_state(partial)
    in_process(args + ["--resume"])
    compare_runs(reference("gpt2", extra=extra), out, ("plan.json", "metrics.json"), exact=("plan.json",))


@pytest.fixture(scope="module", autouse=True)
def report_results():
    yield
    for r in RESULTS:
        print(f"\nresume: {r['case']}: plan identical, largest metric difference {r['largest_difference']:.3g}")

