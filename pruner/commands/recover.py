"""`pruner recover RUN_DIR`: distil the run's base model into its pruned model; a new run folder with the result."""

from __future__ import annotations

import argparse

from pruner.commands import resume_args


def add_parser(sub, common) -> None:
    p = sub.add_parser("recover", parents=[common], help="win back what pruning cost: distil the base into the pruned "
                                                         "model",
                       description="Distil a run's base model (the teacher) into its pruned model (the student, in "
                                   "its pruned shape) with token-level KL, guarded by a held-back validation slice; "
                                   "writes a run folder whose model/ is the recovered model (docs/recovery.md).")
    p.add_argument("run", metavar="RUN_DIR", help="a `pruner prune` run folder")
    p.add_argument("--out", help="output folder (default: RUN_DIR-recovered)")
    p.add_argument("--tokens", type=int, help="training token budget (recovery.tokens)")
    p.add_argument("--data", action="append", metavar="SOURCE",
                   help="generated (default: text the teacher samples) or a data source: shakespeare:train, a local "
                        ".txt file/folder, a Hub dataset id (recovery.data); repeat it to mix sources in equal shares "
                        "(other shares: --set recovery.weights=[2,1])")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a recovery key, e.g. --set recovery.method=lora (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    resume_args(p)
    p.set_defaults(func=run)


def values(args: argparse.Namespace) -> dict:
    """The recovery keys the flags set (values as YAML, as `prune --set` reads them)."""
    import yaml

    out = {}
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        out[key.removeprefix("recovery.")] = yaml.safe_load(raw) if raw else None
    if args.tokens is not None:
        out["tokens"] = args.tokens
    if args.data is not None:
        out["data"] = args.data[0] if len(args.data) == 1 else args.data
        out.setdefault("weights", None)  # sources named here: equal shares unless weights are set here too
    return out


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner.core import distributed
    from pruner.runs.recovery_stage import recover_run

    out = Path(args.out or f"{str(args.run).rstrip('/')}-recovered")
    m = recover_run(args.run, out, values(args), args.overwrite, args.resume, progress=distributed.is_main())
    if distributed.is_main():
        print(summary(m["recovery"], out))
    return 0


def summary(r: dict, out) -> str:
    from pruner.runs.report import divergence_line, verdict_line

    lines = [f"\nrecovery ({r['method']}, teacher {r['teacher']}, data {r['data']}): {r['tokens']:,} tokens in "
             f"{r['seconds']:.0f} s ({r['tokens_per_second']:.0f} tokens/s); validation KL "
             f"{r['validation_kl_pruned']:.4f} -> {r['validation_kl_best']:.4f}"]
    p = r.get("perplexity")
    if p:
        R = "n/a" if p["damage_recovered"] is None else f"{p['damage_recovered']:.2f}"
        lines.append(f"perplexity base {p['base']:.2f}, pruned {p['pruned']:.2f}, recovered {p['recovered']:.2f} "
                     f"(change {p['delta']:+.2f}, 95% CI [{p['ci_low']:+.2f}, {p['ci_high']:+.2f}]); damage "
                     f"recovered R = {R}")
        lines.append(verdict_line(p))
        if p.get("kl_pruned") is not None:
            lines.append(divergence_line(p))
    if r.get("note"):
        lines.append(r["note"])
    lines.append(f"wrote {out}/ (model, metrics.json, report.md, recipe.yaml, provenance.json)")
    return "\n".join(lines)
