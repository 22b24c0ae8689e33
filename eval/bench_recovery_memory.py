"""How honest is recovery's memory estimate? `pruner.recovery.memory.estimate` against the measured peak of a recovery.

    python eval/bench_recovery_memory.py            # the docs table (docs/recovery.md "Memory"; ~25 min on 2 cores)
    python eval/bench_recovery_memory.py --cases llama-shakespeare:full:resident:8:128   # one case

A case is MODEL:METHOD:TEACHER:BATCH:LENGTH[:STEPS] (16 steps unless given). MODEL: a shipped decoder (float32
checkpoint) or the random-weight public shapes of eval/bench_pruned.py (`qwen2.5-0.5b`, `llama-3.2-1b`; the teacher
in bfloat16, as such checkpoints are stored). Each case runs in a fresh process (2 threads): the teacher is loaded,
the student is the teacher with half its query heads removed in every layer (half of each KV group's; every other
head without GQA) in float32, as `pruner recover` loads a run's model; then the kernel's peak-RSS counter is reset
(`/proc/self/clear_refs` = 5) and `recover_models` runs STEPS optimizer steps on the plays' training text (a
validation pass every STEPS / 8: a CPU run's resident memory climbs over its first passes to a plateau; a cached
teacher's cache built first and its weights freed while the student trains, as `pruner recover` does). Measured:
VmHWM minus the VmRSS just before (what recovery needs on top of the loaded models, the allocator's behaviour
included). Estimated: the estimate's total minus what was loaded (the float32 student and the teacher), which is
what the check compares with the free memory. Prints the table; writes eval/results/recovery/bench_memory.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_memory import _status  # beside this script: python puts eval/ on the path

from pruner.core.tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
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
    from bench_pruned import build  # beside this script: python puts eval/ on the path

    return build(name, torch.bfloat16).eval()


def half_heads(model) -> dict[int, list[int]]:
    """Half of every KV group's query heads (every other head without GQA) in every layer."""
    from pruner.core import arch

    g = arch.geometry(model)
    size = g.n_heads // g.n_kv_heads
    gone = [h for h in range(g.n_heads) if (h % size < size // 2 if size > 1 else h % 2)]
    return {layer: gone for layer in range(g.n_layers)}


def student_of(teacher):
    from pruner.pruning import surgery

    student = copy.deepcopy(teacher)
    surgery.remove_heads(student, half_heads(teacher))
    return student.float().eval()


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
    Path("/proc/self/clear_refs").write_text("5")
    before = _status()["VmRSS"]
    recovery_stage.recover_models(student, teacher, tok, rspec, texts=texts,
                                  options=recovery_stage.Options(progress=False),
                                  reload_teacher=(lambda: keep) if released else None)
    measured = _status()["VmHWM"] - before
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
            from gpu_recovery import meta_models  # beside this script

            teacher, student = meta_models(r["model"])
        spec = RecoverySpec(method=r["method"], teacher=r["teacher"], batch_size=r["batch_size"], length=r["length"],
                            tokens=r["steps"] * r["batch_size"] * r["length"], restarts=0)
        parts = memory.estimate(student, teacher, spec, r["method"], teacher_held=r["teacher"] == "resident")
        r.update(estimate_parts=parts, estimate_total_bytes=sum(parts.values()),
                 estimate_bytes=sum(parts.values()) - memory.held_now(student, teacher))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--recompute", help="a bench_memory.json: its estimates again with the code as it is")
    ap.add_argument("--out", default=str(ROOT / "eval" / "results" / "recovery" / "bench_memory.json"))
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case)))
        return
    rows = recompute(Path(args.recompute)) if args.recompute else []
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    for spec in [] if args.recompute else args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--case", spec], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"case {spec} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{spec}: estimate {r['estimate_bytes'] / 2**20:.0f} MiB, measured {r['measured_bytes'] / 2**20:.0f} MiB",
              file=sys.stderr, flush=True)
    mib = lambda n: f"{n / 2**20:,.0f}"  # noqa: E731
    print(markdown_table(
        ["model", "method", "teacher", "batch x length", "steps", "loaded MiB", "estimated MiB", "measured MiB",
         "estimate / measured"],
        [[r["model"], r["method"], r["teacher"], f"{r['batch_size']} x {r['length']}", r["steps"],
          mib(r["loaded_bytes"]),
          mib(r["estimate_bytes"]), mib(r["measured_bytes"]),
          f"{r['estimate_bytes'] / max(r['measured_bytes'], 1):.2f}"] for r in rows]))
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cases": rows, "loadavg": load,
                                          "method": "VmHWM growth during recover_models (clear_refs=5), fresh "
                                                    "process per case"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
