"""`pruner evaluate MODEL_OR_RUN_DIR`: perplexity and downstream accuracy of a model, an export or a run."""

from __future__ import annotations

import argparse


def add_parser(sub, common) -> None:
    p = sub.add_parser("evaluate", parents=[common], help="perplexity and task accuracy of a model, export or run",
                       description="Perplexity on the evaluation windows and, with --tasks, accuracy on "
                                   "lm-evaluation-harness tasks (or the encoder's embedding task). A run folder "
                                   "is rebuilt from its base model and plan and compared with that base on the "
                                   "same windows and documents.")
    p.add_argument("model", metavar="MODEL_OR_RUN_DIR",
                   help="shipped name, local folder, export folder, Hub id, or a `pruner prune` run folder")
    p.add_argument("--tasks", help="comma-separated task names (the shipped offline suite: shakespeare; "
                                   "the Hub suite: boolq,piqa,hellaswag,winogrande,arc_easy,arc_challenge,openbookqa)")
    p.add_argument("--task-path", action="append", metavar="DIR", help="a folder of your own task YAML (repeatable)")
    p.add_argument("--task-limit", type=int, help="score the first N documents of each task")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    p.add_argument("--base", help="also evaluate this base model and report paired changes (default for a run "
                                  "folder: its base model)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set evaluation.num_samples=32 (repeatable)")
    p.add_argument("--out", help="also write evaluation.json and evaluation.md into this folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import yaml

    from pruner import api
    from pruner.core import outputs

    options = {k: v for k, v in {
        "tasks": [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None,
        "task_paths": args.task_path, "task_limit": args.task_limit, "num_fewshot": args.num_fewshot}.items()
        if v is not None}

    for item in args.set or []:  # dotted recipe keys, values as YAML (as `prune --set` reads them)
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        options[key] = yaml.safe_load(raw) if raw else None

    def evaluate():
        return api.evaluate(args.model, base=args.base, **options)

    if args.out:
        with outputs.atomic_dir(Path(args.out), args.overwrite) as tmp:  # unwritable or existing: before compute
            result = evaluate()
            (tmp / "evaluation.json").write_text(json.dumps(result.metrics, indent=1) + "\n")
            (tmp / "evaluation.md").write_text(summary(result) + "\n")
    else:
        result = evaluate()
    print("\n" + summary(result))
    if args.out:
        print(f"\nwrote {args.out}/ (evaluation.json, evaluation.md)")
    return 0


def summary(result) -> str:
    m = result.metrics
    lines = [f"{m['model']}: perplexity {m['perplexity']:.2f} on {m['windows']} windows ({m['tokens']} tokens)"]
    if "delta" in m:
        lines.append(f"base {m['base_model']}: perplexity {m['base']:.2f}; change {m['delta']:+.2f} "
                     f"(95% CI [{m['ci_low']:+.2f}, {m['ci_high']:+.2f}])")
    if m.get("tasks"):
        lines += ["", result.table()]
    return "\n".join(lines)
