"""`pruner prune RECIPE`: calibrate, score, select, evaluate, prune, save the run folder (and export)."""

from __future__ import annotations

import argparse

from pruner.commands import recipe_args


def add_parser(sub, common) -> None:
    p = sub.add_parser("prune", parents=[common], help="calibrate, score, select, prune, evaluate, save",
                       description="Prune attention heads as a recipe says, and measure the damage.")
    recipe_args(p, default_out="runs/<recipe name>")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner import api
    from pruner.commands import recipe_overrides
    from pruner.commands.export import print_export
    from pruner.core import distributed
    from pruner.runs import export, folders
    from pruner.runs.recipe_io import load_recipe

    recipe = load_recipe(args.recipe, recipe_overrides(args))
    out = Path(args.out or f"runs/{Path(args.recipe).stem}")
    main = distributed.is_main()  # several processes: each computes its shard; rank 0 writes and prints
    with folders.run_folder(out, args.overwrite, args.resume) as tmp:
        result = api.prune(recipe=recipe, checkpoint_dir=tmp, progress=main)
        if main:
            folders.save_run(result, tmp)
    if not main:
        return 0
    print_summary(result.metrics, out, bool(result.compensation))
    ex = recipe.export
    if ex.format != "none":  # the recipe's export section: the same as `pruner export RUN_DIR`
        try:
            done = export.export_run(out, ex.format, out / f"export-{ex.format}",
                                     hub=export.Hub(ex.push_to_hub, ex.private))
        except export.ExportError as e:
            raise export.ExportError(f"{e} (the run itself is complete in {out}/)") from None
        print_export(*done)
    return 0


def print_summary(m: dict, out, compensated: bool) -> None:
    """What was pruned, what it cost, and whose convention sensitivity is shown."""
    from pruner.runs import folders

    _print_notes(m)
    _print_evaluation(m)
    _print_sensitivity(m)
    _print_refit(m)
    if m.get("layer_by_layer"):
        print(f"layer by layer: {m['layer_by_layer']}")
    if m.get("bench"):
        from pruner.evaluation.bench import BenchResult

        print(BenchResult.from_dict(m["bench"]).summary())
    _print_model(m, out)
    print(f"wrote {out}/ (model, plan.json, metrics.json, recipe.yaml, report.md, provenance.json"
          + (f", {folders.COMPENSATION_FILE})" if compensated else ")"))


def _print_notes(m: dict) -> None:
    """The selection, automatic-choice and compensation notes, each where the run has one."""
    if m.get("selection_note"):
        print(f"\n{m['selection_note']}")
    if m.get("auto"):
        print(f"\n{m['auto']['line']}")
    if m.get("compensation_note"):
        print(f"\n{m['compensation_note']}")
    if m.get("layer_note"):
        print(f"\n{m['layer_note']}")


def _print_evaluation(m: dict) -> None:
    """What was pruned, and the perplexity, fidelity and task changes it cost."""
    e = m["evaluation"]
    layers = f" (the whole attention of layers {m['removed_layers']})" if m.get("unit") == "layer" else ""
    print(f"\npruned {m['pruned_heads']}/{m['total_heads']} heads{layers} of {m['model']} "
          f"({m['scorer']}, {m['compensation']} compensation, {m['surgery']})")
    print(f"perplexity {e['base']:.2f} -> {e['pruned']:.2f}  (change {e['delta']:+.2f}, "
          f"95% CI [{e['ci_low']:+.2f}, {e['ci_high']:+.2f}], {e['windows']} windows)")
    if "fidelity" in e:
        print(f"embedding fidelity (mean cosine to the unpruned model): {e['fidelity']:.4f}")
    for task, metrics in e.get("tasks", {}).items():
        for metric, d in metrics.items():
            print(f"{task} {metric} {d['base']:.3f} -> {d['pruned']:.3f}  (change {d['delta']:+.3f}, "
                  f"95% CI [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}], {d['docs']} documents)")


def _print_sensitivity(m: dict) -> None:
    """The convention sensitivity: of this plan, or of a naive cosine plan when the scorer reads one convention."""
    sens = m.get("convention_sensitivity")
    if sens and sens.get("of_this_plan"):
        print(f"convention sensitivity: {sens['changed']} of the {m['pruned_heads']} pruned heads change between "
              f"the {sens['convention']} and {sens['other']} conventions")
    elif sens:
        print(f"convention sensitivity of a naive cosine-redundancy plan at the same target (not the plan pruned "
              f"here, whose scorer reads {m['convention']}): {sens['changed']} of its {m['pruned_heads']} heads "
              f"change between the {sens['convention']} and {sens['other']} conventions")


def _print_refit(m: dict) -> None:
    """A refit's ridge(s) and how much of the pruned heads' energy the kept heads rebuild."""
    fit = m.get("refit")
    if fit and fit["layers"]:  # none where every pruned layer lost all its heads (refit is the mean there)
        worst = max(fit["layers"].items(), key=lambda kv: kv[1]["unexplained"] / max(kv[1]["pruned"], 1e-300))
        ridge = ("ridge per layer by cross-validation: " + ", ".join(f"{v['ridge']:g}" for _, v in sorted(
            fit["layers"].items(), key=lambda kv: int(kv[0]))) if fit["ridge"] == "auto" else f"ridge {fit['ridge']:g}")
        print(f"refit compensation ({fit['mode']}, {ridge}): the kept heads rebuild "
              f"{1 - fit['unexplained'] / max(sum(v['pruned'] for v in fit['layers'].values()), 1e-300):.0%} "
              f"of the pruned heads' energy; least in layer {worst[0]} (see report.md)")


def _print_model(m: dict, out) -> None:
    """Whether model/ was saved, and if so what it is and what loads it."""
    if not m["model_saved"]:
        print(f"model not saved: {m['model_not_saved_because']} (see {out}/model/NOT_SAVED.txt)")
    elif m["surgery"] == "mask":
        print("surgery mode `mask`: model/ keeps every shape, so it is no smaller or faster than the base; "
              "`surgery.mode: remove` (or `pruner export RUN --format compact`) writes a smaller model")
    else:
        how = {"vanilla": "loads with plain from_pretrained, and in serving engines and exporters",
               "per-layer": "pruner.load(path), or from_pretrained with trust_remote_code=True; vLLM, TGI, "
                            "SGLang and ONNX Runtime GenAI load vanilla checkpoints only; llama.cpp runs a Llama or "
                            "Mistral one: pruner export RUN --format gguf"
               }.get(m["model_layout"], "loads with plain from_pretrained")
        print(f"model/: the compact model ({m['model_layout']}; {how}): {m['params_after']:,} parameters "
              f"(base {m['params_before']:,}), {m['model_bytes'] / 1e6:.1f} MB in {m['model_dtype']}")
        if m.get("model_note"):
            print(f"model/: {m['model_note']}")
