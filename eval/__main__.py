"""Regenerate a docs table: the commands behind it, in order, from the repository root, offline.

    python -m eval --list                # every table: its docs page, the commands it runs, the files it writes
    python -m eval TABLE [TABLE ...]     # run them (one after another; the first failure stops)
    python -m eval TABLE --dry-run       # print the commands only

A step's output shows as it runs; where a table is a script's printout (`tee` below), the driver also writes it
to that results file. eval/README.md says what each table needs and how long it runs on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from eval.common import ROOT, child_env

B, S = "eval/results/bench", "eval/results/studies"


@dataclass(frozen=True)
class Step:
    """`python -m module args`, with `env` on top of this environment, its stdout also written to `tee`."""

    module: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    tee: str | None = None

    def line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        cmd = shlex.join(["python", "-m", self.module, *self.args])
        return (env + " " if env else "") + cmd + (f" | tee {self.tee}" if self.tee else "")


@dataclass(frozen=True)
class Table:
    docs: str                # the page and the table it feeds
    steps: tuple[Step, ...]
    writes: tuple[str, ...]  # relative to the repository root


def _split(text: str) -> tuple[str, ...]:
    return tuple(shlex.split(text))


def _steps(module: str, *argsets: str, **env: str) -> tuple[Step, ...]:
    return tuple(Step(module, _split(a), dict(env)) for a in argsets)


def _one(docs: str, module: str, out: str, args: str = "", plot: str | None = None) -> Table:
    """A table one command writes: `python -m module args --out out` (and the plot or markdown beside it)."""
    return Table(docs, _steps(module, f"{args} --out {out}".strip()), (out,) + ((plot,) if plot else ()))


PRUNE_LAYERWISE = "eval.bench.prune_layerwise"
TABLES = {
    "capture": Table("docs/scaling.md: calibration at the cost of one forward pass; the `pruner analyze` default",
                     _steps("eval.bench.capture", "--models gpt2-small-random --lengths 1024,2048 --modes plain,"
                            "calibrate,capture_cos,capture_se,capture,capture_sdpa --repeats 5 "
                            f"--out {B}/capture.json"),
                     (f"{B}/capture.json", f"{B}/capture.png")),
    "capture-calibrate": Table("docs/scaling.md: the GPT-2-small shape's calibration against a plain forward",
                               _steps("eval.bench.capture", "--models gpt2-small-random --lengths 1024,2048 --modes "
                                      f"plain,calibrate --analyze none --repeats 5 --out {B}/capture-calibrate.json"),
                               (f"{B}/capture-calibrate.json", f"{B}/capture-calibrate.png")),
    "calibrate": _one("docs/scaling.md: calibration at real sizes (Qwen2.5-0.5B, Llama-3.2-1B shapes)",
                      "eval.bench.calibrate", f"{B}/calibrate.json", "--cases plain,calibrate --repeats 2"),
    "evaluator": _one("docs/scaling.md: evaluator and gradient scoring", "eval.bench.evaluator", f"{B}/evaluator.json",
                      plot=f"{B}/evaluator.png"),
    "pruned": Table("docs/what-pruning-buys.md: measured at real shapes (PyTorch)",
                    _steps("eval.bench.pruned",
                           "--models gpt2-small,qwen2.5-0.5b --lengths 512,2048 --decode 1x32,8x512 --new-tokens 32 "
                           f"--repeats 5 --out {B}/pruned.json",
                           "--models llama-3.2-1b --targets 0.5 --lengths 512,2048 --decode 1x32,8x512 --new-tokens 32 "
                           f"--repeats 5 --out {B}/pruned.json --append"),
                    (f"{B}/pruned.json", f"{B}/pruned.md")),
    "runtime-onnx": _one("docs/what-pruning-buys.md: ONNX Runtime GenAI", "eval.bench.runtime_onnx",
                         f"{B}/runtime_onnx.json"),
    "runtime-gguf": _one("docs/what-pruning-buys.md: llama.cpp", "eval.bench.runtime_gguf", f"{B}/runtime_gguf.json"),
    "memory": _one("docs/long-runs.md: how close the calibration memory estimate is", "eval.bench.memory",
                   f"{B}/memory.json"),
    "recovery-memory": _one("docs/recovery.md: memory (recovery's estimate against the measured peak)",
                            "eval.bench.recovery_memory", f"{B}/recovery_memory.json"),
    "layerwise": Table("docs/scaling.md: layer-by-layer calibration from disk; two processes against one",
                       _steps("eval.bench.layerwise", "8b --windows 4 --length 256",
                              "70b-width --layers 2 --windows 2 --length 256",
                              "1b --procs 2 --windows 8 --length 256 --threads 1"),
                       tuple(f"{B}/layerwise/{c}.json" for c in ("8b", "70b-width-2", "1b-2proc"))),
    "read-ahead": Table("docs/scaling.md: reading ahead (needs root to drop the page cache)",
                        _steps("eval.bench.layerwise", "8b --windows 4 --length 256")
                        + _steps("eval.bench.read_ahead", "/tmp/pruner-bench-layerwise/8b-all --windows 4 --length 256 "
                                 "--repeats 2"),
                        (f"{B}/layerwise/8b.json", f"{B}/read_ahead.json")),
    "prune-layerwise": Table(
        "docs/scaling.md: measured on this machine (`pruner prune` layer by layer at the 8B shape and the 70B width)",
        _steps(PRUNE_LAYERWISE, "8b --sweep 4,32 --recipe lean --windows 8 --length 128",
               "8b --layers 12 --recipe lean --windows 8 --length 128", "8b --layers 1 --where",
               "8b --layers 32 --where",
               "70b-width --layers 2 --windows 32 --where", "8b --layers 4 --recipe today",
               "8b --layers 4 --recipe today --code /tmp/before")  # git worktree add /tmp/before 2efc1d6
        + _steps(PRUNE_LAYERWISE, "8b --layers 32 --recipe lean --windows 8 --length 128 --label threshold16MiB",
                 MALLOC_MMAP_THRESHOLD_="16777216")
        + _steps(PRUNE_LAYERWISE, "8b --layers 32 --recipe lean --windows 8 --length 128 --label threshold32MiB",
                 MALLOC_MMAP_THRESHOLD_="33554432"),
        tuple(f"{B}/prune_layerwise/{c}.json" for c in (
            "8b-4-lean", "8b-32-lean", "8b-12-lean", "8b-1-default", "8b-32-default", "70b-width-2-default",
            "8b-4-today", "8b-4-today-before", "8b-32-lean-threshold16MiB", "8b-32-lean-threshold32MiB"))),
    "scorers": Table("docs/results.md: the compare tables of every shipped model (runs/ only)",
                     _steps("eval.studies.compare", "scorers")
                     + (Step("eval.studies.scorer_plans", _split("gpt2-shakespeare llama-shakespeare --target 0.25"),
                             tee="runs/reference-plans.md"),),
                     ("runs/compare-RECIPE/", "runs/reference-plans.md")),
    "refit-dev": Table("docs/compensation.md: which compensation, which scorer with refit, sequential refit "
                       "(development split)",
                       _steps("eval.studies.refit",
                              "minilm-causal --windows 256 --targets 0.25,0.4,0.5 --scorers sink-aware,fluctuation "
                              f"--comps zero,mean,refit --out {S}/refit/dev-minilm-causal.json",
                              "minilm-causal --windows 256 --targets 0.25,0.4,0.5 --scorers "
                              "sink-aware,refit-energy,refit-energy*(1-s),gradient,fluctuation,cosine --comps refit "
                              f"--out {S}/refit/dev-minilm-causal-scorers.json",
                              "minilm-causal --windows 256 --targets 0.25,0.4,0.5 --scorers sink-aware --comps "
                              f"refit,refit-seq --threads 1 --out {S}/refit/dev-minilm-causal-sequential.json"),
                       tuple(f"{S}/refit/dev-minilm-causal{c}.json" for c in ("", "-scorers", "-sequential"))),
    "refit-compare": Table("docs/results.md: refit on every shipped model",
                           _steps("eval.studies.compare", "refit gpt2-shakespeare llama-shakespeare minilm-encoder",
                                  "quickstart-10", "quickstart-refit")
                           + (Step("eval.studies.refit_tables", _split("--model quickstart"),
                                   tee=f"{S}/refit/targets-quickstart.md"),),
                           (f"{S}/refit/compare-RECIPE.json", f"{S}/refit/compare-RECIPE.md",
                            f"{S}/refit/targets-quickstart.md")),
    "domains": Table("docs/results.md: every table of the evidence on two kinds of text (included from tables.md)",
                     _steps("eval.studies.compare", "domains")
                     + (Step("eval.studies.domain_tables", tee=f"{S}/domains/tables.md"),),
                     (f"{S}/domains/RECIPE-DOMAIN.json", f"{S}/domains/tables.md")),
    "domains-dev": Table("docs/scorers.md: the default scorer chosen on development splits",
                         _steps("eval.studies.domains", "--comps refit"), (f"{S}/domains/dev.json",)),
    "gemma-dev": Table("docs/evidence/gemma.md: every scorer x compensation on Gemma's development splits",
                       _steps("eval.studies.gemma", "--split dev --compensations mean,refit"),
                       (f"{S}/gemma/dev.json",)),
    "gemma": Table("docs/evidence/gemma.md: the default pair against cosine and entropy, refit against mean, on the "
                   "evaluation splits",
                   _steps("eval.studies.gemma", "--split evaluation --scorers fluctuation,cosine,entropy "
                                                "--compensations refit --windows 256",
                          "--split evaluation --scorers refit-energy --compensations mean,refit "
                          "--targets 0.25,0.4,0.5 --windows 256"),
                   (f"{S}/gemma/evaluation.json",)),
    "gemma-steps": _one("README.md, docs/evidence/gemma.md: how long each Gemma 3 270M step takes on 2 cores, what "
                        "pruning it buys in PyTorch and llama.cpp", "eval.bench.gemma_steps", f"{B}/gemma_steps.json"),
    "gemma-layers": Table("docs/evidence/gemma.md: whole attention layers against query heads on Gemma 3 270M",
                          _steps("eval.studies.gemma_layers", "--split dev --windows 16",
                                 "--split evaluation --windows 64 --counts 2 --scorers layer-cosine,heads "
                                 "--compensations mean --head-compensations refit"),
                          (f"{S}/gemma/layers-dev.json", f"{S}/gemma/layers-evaluation.json")),
    "refit-robust": Table("docs/evidence/compensation.md: refit against mean on a change of text",
                          _steps("eval.studies.refit_robust", "--split dev", "--split evaluation"),
                          (f"{S}/refit/robust_dev.json", f"{S}/refit/robust_evaluation.json")),
    "mixtures": Table("docs/results.md: mixtures and auto (issue 35)",
                      _steps("eval.studies.mixtures", "--split dev", "--split evaluation", "--tables"),
                      (f"{S}/mixtures/dev.json", f"{S}/mixtures/evaluation.json")),
    "plans": _one("docs/export.md: which plan to pick", "eval.studies.plans", f"{S}/plans.json"),
    "tasks": _one("docs/downstream.md: the task suite on the shipped models", "eval.studies.tasks",
                  f"{S}/tasks/suite.json", "--models minilm-causal,minilm"),
    "tasks-compare": Table("docs/downstream.md: accuracy next to perplexity on the causal all-MiniLM-L6-v2",
                           _steps("eval.studies.compare", "quickstart-tasks")
                           + (Step("eval.studies.task_ranks", ("runs/evidence-tasks/compare.json",),
                                   tee=f"{S}/tasks/ranks-quickstart.md"),
                              Step("eval.studies.task_ranks", ("--cells", "runs/evidence-tasks/compare.json"),
                                   tee=f"{S}/tasks/cells-quickstart.md")),
                           (f"{S}/tasks/compare-quickstart.json", f"{S}/tasks/compare-quickstart.md",
                            f"{S}/tasks/ranks-quickstart.md", f"{S}/tasks/cells-quickstart.md")),
    "analyze": Table("docs/convention-audit.md: the convention audits (eval/results/studies/analyze.md)",
                     _steps("eval.studies.analyze"), ("runs/analyze/RUN/",)),
    "recovery": Table("docs/recovery.md: the evidence table",
                      _steps("eval.studies.recovery.study", OMP_NUM_THREADS="1"),
                      (f"{S}/recovery/records.jsonl", f"{S}/recovery/table.md")),
    "gpu": Table("docs/scaling.md: on a GPU; docs/recovery.md: recovery on a GPU (needs one CUDA device)",
                 _steps("eval.gpu.run", "eval/results/gpu"),
                 ("eval/results/gpu/PART.json", "eval/results/gpu/PART.log")),
}


def listing() -> str:
    out = []
    for name, t in TABLES.items():
        out += [f"{name}  ->  {t.docs}", *(f"    {s.line()}" for s in t.steps), f"    writes {', '.join(t.writes)}", ""]
    return "\n".join(out).rstrip()


def run(step: Step) -> None:
    """One step in a child process from the repository root, offline; its stdout shown and, with `tee`, kept."""
    env = child_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **step.env)
    cmd = [sys.executable, "-m", step.module, *step.args]
    if step.tee is None:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        return
    done = subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    path = ROOT / step.tee
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="*", metavar="TABLE", help=f"one of: {', '.join(TABLES)}")
    ap.add_argument("--list", action="store_true", help="every table, its commands and what it writes")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    unknown = [t for t in args.tables if t not in TABLES]
    if unknown:
        ap.error(f"unknown table {unknown[0]!r}; valid: {', '.join(TABLES)}")
    if args.list or not args.tables:
        print(listing())
        return 0
    for name in args.tables:
        for step in TABLES[name].steps:
            print(f"== {name}: {step.line()}  (load {os.getloadavg()[0]:.1f})", flush=True)
            if not args.dry_run:
                run(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
