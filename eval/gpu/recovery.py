"""Recovery on one CUDA device: the CPU's answers on a shipped model, then tokens/s and peak memory at a real shape.

    python -m eval.gpu.recovery [--model llama-3.2-1b] [--out FILE.json]  (needs a GPU; a few minutes on an H200)
    python -m eval.gpu.recovery --predict                                 (anywhere: the estimates alone, no weights)
    python -m eval.gpu.recovery --device cpu --only same --same-steps 2  (the first check's code path on a CPU)

1. The same recovery on the CPU and the GPU (the shipped Llama, half its heads removed, `full`, resident and
   cached, 16 steps): the validation KL of every pass equal to 1e-3 relative (GPU reductions run in another order).
2. At the public shape of `--model` (random weights, `eval.common.random_model`; the teacher in bfloat16, the
   student -- half of every KV group's query heads removed in every layer -- in float32, as `pruner recover`
   trains it): `full` and `lora` with the teacher resident and cached, `--steps` steps of `--batch` x `--length`
   tokens of the plays. Each: recovery's tokens/s, `torch.cuda.max_memory_allocated` over the whole recovery
   (loaded models, cache pass and training), and what `pruner.recovery.memory.estimate` predicted for it.
   `--predict` prints the predictions alone, the models built on the meta device.

Prints one line per check and a markdown table; writes `--out` (default eval/results/gpu/recovery.json). Exits 1
if a check failed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from eval.common import RESULTS, gib, meta_models, random_model, student_of
from eval.common import shipped_plays as plays

CASES = ("full:resident", "full:cached", "lora:resident", "lora:cached")


def recover(student, teacher, spec, reload=None):
    from pruner.checkpoints import loading
    from pruner.runs import recovery_stage

    tok = loading.load_tokenizer("llama-shakespeare")  # ids below every vocabulary here
    return recovery_stage.recover_models(student, teacher, tok, spec, text=recovery_stage.RecoveryText(plays("train")),
                                         options=recovery_stage.Options(progress=False),
                                         access=recovery_stage.TeacherAccess(reload=reload)).record


def same_as_cpu(device: str, steps: int = 16) -> list[str]:
    """Recovery of the shipped Llama on the CPU and on `device`: every validation pass within 1e-3 relative."""
    from pruner.checkpoints import loading
    from pruner.recovery.spec import RecoverySpec

    bad = []
    for kind in ("resident", "cached"):
        spec = RecoverySpec(method="full", teacher=kind, batch_size=8, length=128, tokens=steps * 8 * 128,
                            restarts=0)
        got = {}
        for dev in ("cpu", device):
            teacher = loading.load_model("llama-shakespeare").to(dev).eval()
            keep = copy.deepcopy(teacher) if kind == "cached" else None
            got[dev] = recover(student_of(teacher), teacher, spec, (lambda k=keep: k) if keep is not None else None)
        a, b = ([v for _, v in got[d]["validation_history"]] for d in ("cpu", device))
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
        ok = len(a) == len(b) and worst < 1e-3 and got["cpu"]["kept"] == got[device]["kept"]
        print(f"{'ok  ' if ok else 'FAIL'} llama-shakespeare full {kind}: validation KL on the CPU and {device} "
              f"within {worst:.1e} relative over {len(a)} passes ({a[-1]:.5f} / {b[-1]:.5f})", flush=True)
        if not ok:
            bad.append(f"same-as-cpu {kind}")
    return bad


def predicted(student, teacher, spec, method: str) -> int:
    from pruner.recovery import memory

    return sum(memory.estimate(student, teacher, spec, method, teacher_held=False, cpu=False).values())


def _resident_teacher(name: str, device: str):
    return random_model(name, torch.bfloat16).to(device).eval()


def at_shape(name: str, device: str, steps: int, batch: int, length: int) -> list[dict]:
    from pruner.recovery.spec import RecoverySpec

    rows = []
    for case in CASES:
        method, kind = case.split(":")
        spec = RecoverySpec(method=method, teacher=kind, batch_size=batch, length=length,
                            tokens=steps * batch * length, restarts=0)
        teacher = _resident_teacher(name, device)
        student = student_of(teacher)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        pred = predicted(student, teacher, spec, method)
        reload = functools.partial(_resident_teacher, name, device) if kind == "cached" else None
        t0 = time.perf_counter()
        record = recover(student, teacher, spec, reload)
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated()
        rows.append({"model": name, "method": method, "teacher": kind, "batch": batch, "length": length,
                     "steps": steps, "tokens_per_second": record["tokens_per_second"], "wall_s": round(wall, 1),
                     "peak_allocated": peak, "peak_reserved": torch.cuda.max_memory_reserved(), "predicted": pred,
                     "validation_kl": [record["validation_kl_pruned"], record["validation_kl_best"]]})
        print(f"{name} {case}: {record['tokens_per_second']:,.0f} tokens/s, peak {peak / 2**30:.2f} GiB allocated "
              f"(predicted {pred / 2**30:.2f})", flush=True)
        del teacher, student, record
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    from pruner.core.tables import markdown_table

    return markdown_table(["model", "method", "teacher", "batch x length", "tokens/s", "peak allocated GiB",
                           "predicted GiB", "peak reserved GiB"],
                          [[r["model"], r["method"], r["teacher"], f"{r['batch']} x {r['length']}",
                            f"{r['tokens_per_second']:,.0f}", f"{gib(r['peak_allocated']):.2f}",
                            f"{gib(r['predicted']):.2f}", f"{gib(r['peak_reserved']):.2f}"] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--predict", action="store_true")
    ap.add_argument("--only", choices=("same", "shape"), help="run one of the two checks")
    ap.add_argument("--same-steps", type=int, default=16, help="steps of the first check")
    ap.add_argument("--out", default=str(RESULTS / "gpu" / "recovery.json"))
    args = ap.parse_args()
    from pruner.recovery.spec import RecoverySpec

    if args.predict:
        teacher, student = meta_models(args.model)
        for case in CASES:
            method, kind = case.split(":")
            spec = RecoverySpec(method=method, teacher=kind, batch_size=args.batch, length=args.length)
            print(f"{args.model} {case}, {args.batch} x {args.length}: predicted peak "
                  f"{predicted(student, teacher, spec, method) / 2**30:.2f} GiB allocated")
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_recovery: no CUDA device (--predict prints the estimates anywhere)")
    bad, rows = [], []
    checks = {"same": lambda: same_as_cpu(args.device, args.same_steps),
              "shape": lambda: rows.extend(at_shape(args.model, args.device, args.steps, args.batch, args.length))
              or []}
    for name, check in checks.items():
        if args.only not in (None, name):
            continue
        try:
            bad += check()
        except Exception:  # report every check whatever the others did
            traceback.print_exc()
            bad.append(name)
    if rows:
        print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    out.write_text(json.dumps({"device": device, "rows": rows,
                                                       "failed": bad}, indent=1) + "\n")
    print(f"gpu_recovery: {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
