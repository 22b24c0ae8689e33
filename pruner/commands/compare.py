"""`pruner compare RECIPE`: every scorer x sparsity x compensation (x budget x GQA mode) on the same windows."""

from __future__ import annotations

import argparse

from pruner.commands import recipe_args


def add_parser(sub, common) -> None:
    p = sub.add_parser("compare", parents=[common],
                       help="every scorer x sparsity x compensation on the same windows",
                       description="Compare scorers on one calibration pass and the same evaluation windows.")
    recipe_args(p, default_out="runs/<recipe name>-compare")
    p.add_argument("--scorers", help="comma-separated scorer names (default: all)")
    p.add_argument("--sparsities", default="0.1,0.25,0.4,0.5", help="comma-separated fractions or counts")
    p.add_argument("--compensation", default="zero,mean,refit", help="comma-separated: zero, mean, refit")
    p.add_argument("--budgets", help="comma-separated selection budgets to compare: global, layer "
                                     "(default: the recipe's)")
    p.add_argument("--gqa", help="comma-separated GQA modes to compare: equal, group (default: the recipe's)")
    p.set_defaults(func=run)


def targets(text: str) -> list[float]:
    """`0.1,0.25,8` -> fractions in (0, 1) and whole head counts, as the recipe's selection.target."""
    from pruner.runs.recipe import SelectionSpec

    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = int(x) if x.lstrip("+").isdigit() else float(x)
            out.append(SelectionSpec(target=value).target)
        except Exception:  # noqa: BLE001 - pydantic/ValueError: one message for every bad value
            raise ValueError(f"--sparsities: {x!r} is neither a fraction in (0, 1) nor a whole head count") from None
    return out


def _list(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner import api
    from pruner.commands import recipe_overrides
    from pruner.core import distributed
    from pruner.runs import folders
    from pruner.runs.recipe_io import load_recipe

    recipe = load_recipe(args.recipe, recipe_overrides(args))
    kw = dict(recipe=recipe, scorers=_list(args.scorers), sparsities=targets(args.sparsities),
              compensations=_list(args.compensation), budgets=_list(args.budgets), gqa=_list(args.gqa))
    out = Path(args.out or f"runs/{Path(args.recipe).stem}-compare")
    main = distributed.is_main()  # several processes: each computes its shard; rank 0 writes and prints
    with folders.run_folder(out, args.overwrite, args.resume) as tmp:
        comparison = api.compare(progress=main, checkpoint_dir=tmp, **kw)
        if main:
            table = comparison.write(tmp)
    if not main:
        return 0
    print("\n" + table)
    print(f"\nwrote {out}/ (compare.json, compare.csv, compare.md, compare.png, recipe.yaml, provenance.json)")
    return 0
