"""`pruner plan-memory RECIPE`: the memory a calibration will take, per device and host, from the config alone."""

from __future__ import annotations

import argparse


def add_parser(sub, common) -> None:
    p = sub.add_parser("plan-memory", parents=[common], help="estimate calibration memory from a config alone",
                       description="Build the recipe's model on the meta device from its config.json (no weight is "
                                   "read or downloaded) and estimate the calibration's peak memory on the device "
                                   "and on the host, all-resident and layer by layer (capture.onload), with the "
                                   "recipe's batch size, window length, number of windows and captured sums.")
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe key (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true", help="read a config whose class ships with the model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    from pruner.commands import recipe_overrides
    from pruner.core import assets
    from pruner.pruning.scoring import get_scorer
    from pruner.runs import memory_plan as mp
    from pruner.runs.recipe_io import load_recipe
    from pruner.runs.resources import Sizes, available_memory, model_bytes

    recipe = load_recipe(args.recipe, recipe_overrides(args))
    m, cal = recipe.model, recipe.calibration
    config = AutoConfig.from_pretrained(assets.resolve(m.path), trust_remote_code=m.trust_remote_code)
    config.dtype = getattr(torch, m.dtype)
    model = mp.meta_model(config).to(getattr(torch, m.dtype))
    metrics = len(dict.fromkeys(["cosine", *recipe.capture.metrics]))
    folds = recipe.surgery.folds if recipe.surgery.ridge == "auto" and recipe.surgery.compensation == "refit" else 0
    sizes = Sizes(batch_size=cal.batch_size, length=cal.length, chunk_size=recipe.capture.chunk_size,
                  pair_metrics=metrics, outputs=True, folds=folds, moments=recipe.capture.moments,
                  gradient=get_scorer(recipe.scorer.name).needs_gradient)
    samples = cal.num_samples or 64
    systems = get_scorer(recipe.scorer.name).needs_systems
    plans = [mp.memory_plan(model, sizes, samples, mode, m.device, systems, recipe.capture.hidden == "disk",
                            recipe.capture.read_ahead) for mode in ("all", "sequential")]
    free = available_memory(m.device)
    chosen = recipe.capture.onload if recipe.capture.onload != "auto" else \
        ("sequential" if free is not None and model_bytes(model) > 0.8 * free else "all" if free is not None else "?")
    print(f"{m.path}: {model_bytes(model) / 2**30:.1f} GiB of weights in {m.dtype}; calibration of {samples} "
          f"windows x {cal.length} tokens, batch {cal.batch_size}, on {m.device}" +
          (f", {folds} folds for ridge auto" if folds else "") + "\n")
    print(mp.render(plans, m.device, chosen))
    ev = recipe.evaluation
    print("\n" + mp.after_plan(model, ev.num_samples, ev.length, ev.batch_size, recipe.capture.read_ahead))
    return 0
