"""How honest is recovery's memory estimate? `pruner.recovery.memory.estimate` against the measured peak of a recovery.

    python -m eval.bench.recovery_memory      # the docs table (docs/recovery.md "Memory"; ~25 min on 2 cores)
    python -m eval.bench.recovery_memory --cases llama-shakespeare:full:resident:8:128 --out runs/bench/rm.json

A case is MODEL:METHOD:TEACHER:BATCH:LENGTH[:STEPS] (16 steps unless given). MODEL: a shipped decoder (float32
checkpoint) or the random-weight public shapes (`eval.common.random_model`: `qwen2.5-0.5b`, `llama-3.2-1b`; the teacher
in bfloat16, as such checkpoints are stored). Each case runs in a fresh process (2 threads): the teacher is loaded,
the student is the teacher with half its query heads removed in every layer (half of each KV group's; every other
head without GQA) in float32, as `pruner recover` loads a run's model; then the kernel's peak-RSS counter is reset
(`/proc/self/clear_refs` = 5) and `recover_models` runs STEPS optimizer steps on the plays' training text (a
validation pass every STEPS / 8: a CPU run's resident memory climbs over its first passes to a plateau; a cached
teacher's cache built first and its weights freed while the student trains, as `pruner recover` does). Measured:
VmHWM minus the VmRSS just before (what recovery needs on top of the loaded models, the allocator's behaviour
included). Estimated: the estimate's total minus what was loaded (the float32 student and the teacher), which is
what the check compares with the free memory. Prints the table; writes `--out` (default
eval/results/bench/recovery_memory.json).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from eval.common import RESULTS, child_env, estimate_cases, meta_models, random_model, student_of, write_estimates
from pruner.core.proc_status import PeakGrowth
from pruner.core.tables import markdown_table

CASES = ["llama-shakespeare:full:resident:8:128", "minilm-causal:full:resident:8:128",
         "minilm-causal:full:cached:8:128", "minilm-causal:lora:resident:8:128",
         "qwen2.5-0.5b:lora:resident:8:128", "qwen2.5-0.5b:full:cached:2:128", "qwen2.5-0.5b:full:resident:2:128",
         "llama-3.2-1b:lora:resident:4:128:8"]


def teacher_of(name: str):
    """The teacher: a shipped checkpoint, or a public shape with random weights in bfloat16."""
    import torch

    from pruner.checkpoints import loading

    if name in ("llama-shakespeare", "gpt2-shakespeare", "minilm-causal"):
        return loading.load_model(name).eval()
    return random_model(name, torch.bfloat16).eval()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def case(spec: str) -> dict:
    import torch

    from pruner.checkpoints import loading
    from pruner.core import data
    from pruner.recovery import memory
    from pruner.recovery.spec import RecoverySpec
    from pruner.runs import recovery_memory, recovery_stage

    name, method, kind, B, T, *steps = spec.split(":")
    B, T, steps = int(B), int(T), int(steps[0]) if steps else 16
    torch.set_num_threads(2)
    teacher = teacher_of(name)
    student = student_of(teacher)
    tok = loading.load_tokenizer("llama-shakespeare")  # ids below every vocabulary here: only the sizes matter
    texts = data.load_texts(data.TextSource("shakespeare:train"))
    rspec = RecoverySpec(method=method, teacher=kind, batch_size=B, length=T, tokens=steps * B * T,
                         restarts=0)
    released = kind == "cached"
    est = recovery_memory.estimate(student, teacher, rspec, method, teacher_held=not released)
    held = memory.held_now(student, teacher)
    keep = copy.deepcopy(teacher) if released else None  # the teacher read again after training
    with PeakGrowth() as peak:
        recovery_stage.recover_models(student, teacher, tok, rspec, text=recovery_stage.RecoveryText(texts),
                                  options=recovery_stage.Options(progress=False),
                                  access=recovery_stage.TeacherAccess(reload=(lambda: keep) if released else None))
    measured = peak.bytes
    return {"case": spec, "model": name, "method": method, "teacher": kind, "batch_size": B, "length": T,
            "steps": steps,
            # `held` from before: once the freed teacher is on `meta` its tied weights count twice
            "loaded_bytes": held, "estimate_bytes": est.total - held,
            "estimate_total_bytes": est.total, "estimate_parts": est.parts, "measured_bytes": measured}


def recompute(path: Path) -> list[dict]:
    """The records of `path` with the estimate of the code as it is (the measured peaks kept): random shapes built
    on the meta device, shipped models loaded."""
    from pruner.recovery import memory
    from pruner.recovery.spec import RecoverySpec

    rows = json.loads(path.read_text())["cases"]
    for r in rows:
        if r["model"] in ("llama-shakespeare", "gpt2-shakespeare", "minilm-causal"):
            teacher = teacher_of(r["model"])
            student = student_of(teacher)
        else:
            teacher, student = meta_models(r["model"])
        spec = RecoverySpec(method=r["method"], teacher=r["teacher"], batch_size=r["batch_size"], length=r["length"],
                            tokens=r["steps"] * r["batch_size"] * r["length"], restarts=0)
        parts = memory.estimate(student, teacher, spec, r["method"], teacher_held=r["teacher"] == "resident")
        r.update(estimate_parts=parts, estimate_total_bytes=sum(parts.values()),
                 estimate_bytes=sum(parts.values()) - memory.held_now(student, teacher))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--recompute", help="a recovery_memory.json: its estimates again with the code as it is")
    ap.add_argument("--out", default=str(RESULTS / "bench" / "recovery_memory.json"))
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case)))
        return
    if args.recompute:
        rows = recompute(Path(args.recompute))
    else:
        rows = estimate_cases(__spec__.name, args.cases.split(","), child_env(OMP_NUM_THREADS="2"))
    print(markdown_table(
        ["model", "method", "teacher", "batch x length", "steps", "loaded MiB", "estimated MiB", "measured MiB",
         "estimate / measured"],
        [[r["model"], r["method"], r["teacher"], f"{r['batch_size']} x {r['length']}", r["steps"],
          _mib(r["loaded_bytes"]), _mib(r["estimate_bytes"]), _mib(r["measured_bytes"]),
          f"{r['estimate_bytes'] / max(r['measured_bytes'], 1):.2f}"] for r in rows]))
    write_estimates(args.out, rows, "VmHWM growth during recover_models (clear_refs=5), fresh process per case")


if __name__ == "__main__":
    main()
