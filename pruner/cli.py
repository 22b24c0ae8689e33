"""The `pruner` command line. Exposes only what works."""

from __future__ import annotations

import argparse
import sys

from pruner import __version__


def _parse_sinks(text: str | None, causal: bool):
    """`first`, `bos`, `special`, `auto`, `ids:1,2` or `positions:0,1` -> SinkSpec."""
    from pruner.sinks import SinkSpec, default_spec

    if text is None:
        return default_spec(causal)
    mode, _, values = text.partition(":")
    nums = tuple(int(v) for v in values.split(",") if v.strip()) if values else ()
    if mode == "ids":
        return SinkSpec("ids", ids=nums)
    if mode == "positions":
        return SinkSpec("positions", positions=nums)
    if values:
        raise ValueError(f"sink mode {mode!r} takes no values")
    return SinkSpec(mode)


def _sinks(args: argparse.Namespace) -> int:
    import torch

    from pruner import audit, data, models
    from pruner.capture import CaptureConfig, capture_stats, resolve_auto_sinks
    from pruner.eager import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load_model(args.model)
    tok = models.load_tokenizer(args.model)
    causal = models.attends_causally(model)
    spec = _parse_sinks(args.sinks, causal)
    texts = data.load_texts(data.TextSource(args.data))
    unit = args.unit or ("windows" if causal else "lines")
    if unit == "windows":
        batch = data.token_windows(tok, texts, args.length, bos=not args.no_bos,
                                   num_samples=args.num_samples, seed=args.seed)
    else:
        batch = data.line_samples(tok, texts, args.length, num_samples=args.num_samples, seed=args.seed)
    if spec.mode == "auto":
        spec = resolve_auto_sinks(model, batch, tok, eps=spec.eps, batch_size=args.batch_size)
        print(f"auto sinks (eps {spec.eps}): positions {list(spec.positions)}, token ids {list(spec.ids)}")
    from pruner import distributed

    st = capture_stats(model, batch, spec, tok, CaptureConfig(metrics=("cosine",)),
                       batch_size=args.batch_size, progress=distributed.is_main())
    if not distributed.is_main():  # several processes: rank 0 prints
        return 0
    print(f"\n{args.model}: sink mass per layer x head (sinks: {spec.mode}; {len(batch)} {unit} "
          f"of {args.data}, {int(st.rows[0])} query rows)")
    print(format_table(st.sink_mass))
    upper = st.sink_mass[1:].flatten()
    print(f"layers >= 1: {int((upper >= 0.3).sum())}/{upper.numel()} heads with sink mass >= 0.3; "
          f"entropy full {st.entropy_full.mean():.2f} vs content {st.entropy_content.mean():.2f} nats")
    flips = audit.nn_flip_rate(st.pairs["cosine/full"], st.pairs["cosine/content"], similarity=True)
    print("nearest neighbour by cosine, FULL vs CONTENT: agree for "
          + ", ".join(f"L{i} {1 - f:.0%}" for i, f in enumerate(flips.tolist()))
          + f" of heads (overall {1 - flips.mean():.0%})")
    return 0


def _load_recipe(args):
    from pruner.recipe import load_recipe

    return load_recipe(args.recipe, args.set or [])


def _prune(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pruner import distributed, pipeline, report

    recipe = _load_recipe(args)
    out = Path(args.out or f"runs/{Path(args.recipe).stem}")
    if not distributed.is_main():  # several processes: each computes its shard; rank 0 writes and prints
        pipeline.run(recipe, out, progress=False)
        return 0
    tmp, commit, abort = report.atomic_dir(out, args.overwrite)
    try:
        result = pipeline.run(recipe, out)
        pipeline.save_model(result, tmp / "model")
        plan_json = result.plan.to_json()
        (tmp / "plan.json").write_text(plan_json + "\n")
        (tmp / "metrics.json").write_text(json.dumps(pipeline.to_jsonable(result.metrics), indent=1) + "\n")
        (tmp / "recipe.yaml").write_text(recipe.to_yaml())
        (tmp / "report.md").write_text(report.run_report(result.metrics, plan_json))
        commit()
    except BaseException:
        abort()
        raise
    m, e = result.metrics, result.metrics["evaluation"]
    print(f"\npruned {m['pruned_heads']}/{m['total_heads']} heads of {m['model']} "
          f"({m['scorer']}, {m['compensation']} compensation, {m['surgery']})")
    print(f"perplexity {e['base']:.2f} -> {e['pruned']:.2f}  (change {e['delta']:+.2f}, "
          f"95% CI [{e['ci_low']:+.2f}, {e['ci_high']:+.2f}], {e['windows']} windows)")
    if "fidelity" in e:
        print(f"embedding fidelity (mean cosine to the unpruned model): {e['fidelity']:.4f}")
    sens = m.get("convention_sensitivity")
    if sens:
        print(f"convention sensitivity ({sens['scorer']} redundancy): {sens['changed']} of {m['pruned_heads']} "
              f"selected heads change between the {sens['convention']} and {sens['other']} conventions")
    if not m["model_saved"]:
        print(f"model not saved: {m['model_not_saved_because']} (see {out}/model/NOT_SAVED.txt)")
    print(f"wrote {out}/ (model, plan.json, metrics.json, recipe.yaml, report.md)")
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner import distributed, pipeline, report
    from pruner.scoring import SCORERS, get_scorer

    recipe = _load_recipe(args)
    scorers = args.scorers.split(",") if args.scorers else list(SCORERS)
    for name in scorers:
        get_scorer(name)
    comps = args.compensation.split(",")
    bad = [c for c in comps if c not in ("zero", "mean")]
    if bad:
        raise ValueError(f"unknown compensation {bad}; valid: zero, mean")
    out = Path(args.out or f"runs/{Path(args.recipe).stem}-compare")
    if not distributed.is_main():  # several processes: each computes its shard; rank 0 writes and prints
        pipeline.compare(recipe, scorers, _floats(args.sparsities), comps, progress=False)
        return 0
    tmp, commit, abort = report.atomic_dir(out, args.overwrite)
    try:
        records = pipeline.compare(recipe, scorers, _floats(args.sparsities), comps)
        table = report.write_compare(records, recipe, tmp)
        commit()
    except BaseException:
        abort()
        raise
    print("\n" + table)
    print(f"\nwrote {out}/ (compare.json, compare.csv, compare.md, compare.png, recipe.yaml)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pruner", description="Sink-aware attention-head pruning for Hugging Face checkpoints.")
    ap.add_argument("--version", action="version", version=f"pruner {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser("sinks", help="layer x head table of attention-sink mass",
                        description="How much attention each head puts on the sink (default: first token "
                                    "for decoders, [CLS]/[SEP] for encoders), and whether heads' nearest "
                                    "neighbours survive removing the sink. Streaming capture: no T x T maps.")
    sp.add_argument("model", nargs="?", default="minilm-causal",
                    help="shipped checkpoint name, local folder or Hub id (default: minilm-causal)")
    sp.add_argument("--data", default="shakespeare:evaluation",
                    help="shakespeare:<split>, a local .txt file/folder, or a Hub dataset id")
    sp.add_argument("--sinks", default=None,
                    help="first | bos | special | auto | ids:ID,... | positions:P,... (default by model)")
    sp.add_argument("--unit", choices=("windows", "lines"), default=None,
                    help="fixed-length windows (decoder default) or one sample per line (encoder default)")
    sp.add_argument("--length", type=int, default=128, help="window length / max line length in tokens")
    sp.add_argument("--num-samples", type=int, default=32)
    sp.add_argument("--no-bos", action="store_true", help="do not start decoder windows with BOS")
    sp.add_argument("--batch-size", type=int, default=8)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--threads", type=int, default=None)
    sp.set_defaults(func=_sinks)

    def recipe_args(p):
        p.add_argument("recipe", help="YAML recipe (see recipes/)")
        p.add_argument("--out", help="output folder (default: runs/<recipe name>[-compare])")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a recipe key, e.g. --set selection.target=0.4 (repeatable)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    pp = sub.add_parser("prune", help="calibrate, score, select, prune, evaluate, save",
                        description="Prune attention heads as a recipe says, and measure the damage.")
    recipe_args(pp)
    pp.set_defaults(func=_prune)

    cp = sub.add_parser("compare", help="every scorer x sparsity x compensation on the same windows",
                        description="Compare scorers on one calibration pass and the same evaluation windows.")
    recipe_args(cp)
    cp.add_argument("--scorers", help="comma-separated scorer names (default: all)")
    cp.add_argument("--sparsities", default="0.1,0.25,0.4,0.5", help="comma-separated fractions or counts")
    cp.add_argument("--compensation", default="zero,mean", help="zero, mean or both (comma-separated)")
    cp.set_defaults(func=_compare)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pruner: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
