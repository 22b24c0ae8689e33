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
    from pruner.commands import recipe_overrides
    from pruner.core import arch
    from pruner.core.runtime import model_bytes
    from pruner.pruning.selection import SelectionError, check_target
    from pruner.runs import calibration_memory, prune_memory
    from pruner.runs.pipeline import selection_config
    from pruner.runs.recipe_io import load_recipe
    from pruner.runs.resources import available_memory

    recipe = load_recipe(args.recipe, recipe_overrides(args))
    m, cal = recipe.model, recipe.calibration
    model = prune_memory.recipe_model(recipe)
    try:
        quota = check_target(arch.geometry(model), selection_config(recipe, model))[1]
        refused = None
    except SelectionError as e:  # `prune` would refuse this target: planned as a global budget, and said
        quota, refused = None, str(e)
    sequential = prune_memory.run_plan(recipe, model, quota)
    calibration = prune_memory.calibration_sizes(recipe, model, quota)
    whole = calibration_memory.memory_plan(model, calibration, cal.num_samples or 64, "all", m.device,
                                           prune_memory.scorer_of(recipe).needs_systems)
    free = available_memory(m.device)
    chosen = recipe.capture.onload if recipe.capture.onload != "auto" else \
        ("sequential" if free is not None and model_bytes(model) > 0.8 * free else "all" if free is not None else "?")
    print(f"{m.path}: {model_bytes(model) / 2**30:.1f} GiB of weights in {m.dtype}; calibration of "
          f"{cal.num_samples or 64} windows x {cal.length} tokens, batch {cal.batch_size}, on {m.device}" +
          (f", {calibration.folds} folds for ridge auto" if calibration.folds else "") +
          "; all: the calibration with the whole model resident; sequential: the whole `pruner prune` a block at "
          "a time\n")
    print(calibration_memory.render([whole, sequential], m.device, chosen))
    if refused:
        print(f"\nnote: `pruner prune` refuses this selection ({refused}); planned here as a global budget")
    return 0
