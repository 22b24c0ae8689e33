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
    try:
        nums = tuple(int(v) for v in values.split(",") if v.strip()) if values else ()
    except ValueError:
        raise ValueError(f"invalid sink spec {text!r}: values must be whole numbers, e.g. ids:101,102 "
                         "or positions:0,1") from None
    if mode == "ids":
        return SinkSpec("ids", ids=nums)
    if mode == "positions":
        return SinkSpec("positions", positions=nums)
    if values:
        raise ValueError(f"sink mode {mode!r} takes no values")
    return SinkSpec(mode)


def _sinks(args: argparse.Namespace) -> int:
    import torch

    from pruner import audit, distributed, models
    from pruner.capture import CaptureConfig, capture_stats
    from pruner.eager import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load_model(args.model)
    tok = models.load_tokenizer(args.model)
    causal = models.attends_causally(model)
    batch, unit = _samples(args, tok, causal, args.length)
    spec = _resolved_sinks(args, model, tok, batch, causal)
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


def _samples(args, tok, causal: bool, length: int):
    """The token rows of `--data`: windows (decoder default) or lines (encoder default) of `length` tokens."""
    from pruner import data

    unit = args.unit or ("windows" if causal else "lines")
    batch = data.samples(tok, data.load_texts(data.TextSource(args.data)), unit, length, bos=not args.no_bos,
                         num_samples=args.num_samples, seed=args.seed)
    return batch, unit


def _resolved_sinks(args, model, tok, batch, causal: bool):
    """`--sinks` for these samples: parsed, `auto` resolved on them, checked to leave content rows."""
    from pruner.capture import resolve_auto_sinks
    from pruner.sinks import check_content

    spec = _parse_sinks(args.sinks, causal)
    if spec.mode == "auto":
        spec = resolve_auto_sinks(model, batch, tok, eps=spec.eps, batch_size=args.batch_size)
        print(f"auto sinks (eps {spec.eps}): positions {list(spec.positions)}, token ids {list(spec.ids)}")
    check_content(batch.input_ids, batch.attention_mask, spec, tok)
    return spec


def _same_tokenizer(a, b, names: tuple[str, str]) -> None:
    if a.get_vocab() != b.get_vocab() or a.all_special_ids != b.all_special_ids:
        raise ValueError(f"--compare-to needs the same tokenizer (the same token rows): {names[0]} and "
                         f"{names[1]} tokenise differently")


def _thresholds(items: list[str] | None) -> dict[str, float]:
    """`cosine=0.5` (repeatable) -> {"cosine": 0.5}."""
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--threshold takes METRIC=NUMBER, e.g. cosine=0.5; got {item!r}") from None
    return out


def _analysis_header(args, config, spec, unit: str, samples: int, stats) -> dict:
    """What was analysed, on which rows: the first keys of analysis.json."""
    import dataclasses

    from pruner import __version__

    return {"pruner_version": __version__, "model": args.model, "compare_to": args.compare_to,
            "n_layers": int(stats.sink_mass.shape[0]), "n_heads": int(stats.sink_mass.shape[1]),
            "metrics": list(config.metrics),
            "sinks": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()},
            "data": {"source": args.data, "unit": unit, "samples": samples, "max_length": args.max_length,
                     "seed": args.seed, "query_rows": int(stats.rows[0]), "content_rows": int(stats.content_rows[0]),
                     "excluded_rows": int(stats.excluded_rows[0])}}


def _analysis(args: argparse.Namespace, config, cap_config, folder):
    """Load, capture, analyse and write analysis.json, report.md and the figures into `folder`."""
    import json

    from pruner import analysis, arch, models
    from pruner import analysis_report as ar
    from pruner.capture import CaptureConfig, capture_stats

    model, tok = models.load_model(args.model), models.load_tokenizer(args.model)
    causal = models.attends_causally(model)
    reference = None
    if args.compare_to:
        _same_tokenizer(tok, models.load_tokenizer(args.compare_to), (args.model, args.compare_to))
        reference = models.load_model(args.compare_to)
        shape = lambda m: (arch.geometry(m).n_layers, arch.geometry(m).n_heads)  # noqa: E731
        if shape(model) != shape(reference):
            raise ValueError(f"--compare-to needs the same layers x heads: {args.model} has {shape(model)}, "
                             f"{args.compare_to} {shape(reference)}")
    batch, unit = _samples(args, tok, causal, args.max_length)
    spec = _resolved_sinks(args, model, tok, batch, causal)
    print(f"{args.model}: {len(batch)} {unit} of {args.data}, sinks {spec.mode}; every head against every head")
    stats = capture_stats(model, batch, spec, tok, cap_config, batch_size=args.batch_size, progress=True)
    res = _analysis_header(args, config, spec, unit, len(batch), stats)
    print("clustering and MDS ...")
    res.update(analysis.analyze(stats, config))
    if reference is not None:
        print(f"{args.compare_to}: the same {len(batch)} {unit}")
        ref = capture_stats(reference, batch, spec, tok, CaptureConfig(chunk_size=args.chunk_size, metrics=()),
                            batch_size=args.batch_size, progress=True)
        res["entropy_attribution"] = {"reference": args.compare_to, **analysis.entropy_attribution(ref, stats),
                                      "reference_heads": analysis.head_tables(ref)}
    (folder / "analysis.json").write_text(json.dumps(res, indent=1) + "\n")
    figures = ar.write_figures(res, folder)
    (folder / "report.md").write_text(ar.report_markdown(res, figures))
    return res, reference, figures


def _analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from pruner import analysis, report
    from pruner import analysis_report as ar
    from pruner.capture import CaptureConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    config = analysis.AnalysisConfig(metrics=metrics, thresholds=_thresholds(args.threshold),
                                     clusters=args.clusters, seed=args.seed)
    cap_config = CaptureConfig(chunk_size=args.chunk_size, metrics=metrics, across_layers=True)
    out = Path(args.out)
    with report.atomic_dir(out, args.overwrite) as tmp:  # unwritable or existing: fail before compute
        res, reference, figures = _analysis(args, config, cap_config, tmp)
    print("\n" + report.markdown_table(ar.SUMMARY_HEADER, ar.summary_rows(res)))
    if reference is not None:
        ov = res["entropy_attribution"]["overall"]
        print(f"\nentropy {args.compare_to} -> {args.model}: {ov['delta']:+.3f} nats per head = sink "
              f"{ov['sink_part']:+.3f} + content {ov['content_part']:+.3f} (sink share {ar.pct(ov['sink_share'])})")
    print(f"\nwrote {out}/ (analysis.json, report.md, {', '.join(figures)})")
    return 0


def _load_recipe(args):
    from pruner.recipe import load_recipe

    return load_recipe(args.recipe, args.set or [])


def _prune(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pruner import distributed, export, pipeline, report

    recipe = _load_recipe(args)
    out = Path(args.out or f"runs/{Path(args.recipe).stem}")
    if not distributed.is_main():  # several processes: each computes its shard; rank 0 writes and prints
        pipeline.run(recipe, out, progress=False)
        return 0
    with report.atomic_dir(out, args.overwrite) as tmp:
        result = pipeline.run(recipe, out)
        pipeline.save_model(result, tmp / "model")
        export.save_compensation(result.bias, tmp / export.COMPENSATION_FILE)
        plan_json = result.plan.to_json()
        (tmp / "plan.json").write_text(plan_json + "\n")
        (tmp / "metrics.json").write_text(json.dumps(pipeline.to_jsonable(result.metrics), indent=1) + "\n")
        (tmp / "recipe.yaml").write_text(recipe.to_yaml())
        (tmp / "report.md").write_text(report.run_report(result.metrics, plan_json))
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
    print(f"wrote {out}/ (model, plan.json, metrics.json, recipe.yaml, report.md"
          + (f", {export.COMPENSATION_FILE})" if result.bias else ")"))
    ex = recipe.export
    if ex.format != "none":  # the recipe's export section: the same as `pruner export RUN_DIR`
        try:
            done = export.export_run(out, ex.format, out / f"export-{ex.format}", repo_id=ex.push_to_hub,
                                     private=ex.private)
        except export.ExportError as e:
            raise export.ExportError(f"{e} (the run itself is complete in {out}/)") from None
        _report_export(*done)
    return 0


def _report_export(done, url) -> None:
    print(f"exported a {done.format} checkpoint: {done.params:,} parameters, {done.bytes / 1e6:.1f} MB of weights; "
          f"reloads with vanilla transformers (max |logit difference| {done.max_diff:.1e})")
    print(f"wrote {done.folder}/ (checkpoint, README.md model card, plan.json)")
    if url:
        print(f"pushed to {url}")


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner import export

    if args.private and not args.push_to_hub:
        raise ValueError("--private applies only with --push-to-hub REPO_ID")
    out = Path(args.out or Path(args.run_dir) / f"export-{args.format}")
    _report_export(*export.export_run(Path(args.run_dir), args.format, out, args.overwrite,
                                      repo_id=args.push_to_hub, private=args.private))
    return 0


def _targets(text: str) -> list[float]:
    """`0.1,0.25,8` -> fractions in (0, 1) and whole head counts, as the recipe's selection.target."""
    from pruner.recipe import SelectionSpec

    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = int(x) if x.lstrip("+").isdigit() else float(x)
            out.append(SelectionSpec(target=value).target)
        except Exception:  # noqa: BLE001 - pydantic/ValueError: one message for every bad value
            raise ValueError(f"--sparsities: {x!r} is neither a fraction in (0, 1) nor a whole head count") from None
    return out


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
    targets = _targets(args.sparsities)
    out = Path(args.out or f"runs/{Path(args.recipe).stem}-compare")
    if not distributed.is_main():  # several processes: each computes its shard; rank 0 writes and prints
        pipeline.compare(recipe, scorers, targets, comps, progress=False)
        return 0
    with report.atomic_dir(out, args.overwrite) as tmp:
        records = pipeline.compare(recipe, scorers, targets, comps)
        table = report.write_compare(records, recipe, tmp)
    print("\n" + table)
    print(f"\nwrote {out}/ (compare.json, compare.csv, compare.md, compare.png, recipe.yaml)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pruner", description="Sink-aware attention-head pruning for Hugging Face checkpoints.")
    ap.add_argument("--version", action="version", version=f"pruner {__version__}")
    ap.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)  # `--debug` also after the command name
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    sp = sub.add_parser("sinks", parents=[common], help="layer x head table of attention-sink mass",
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

    an = sub.add_parser("analyze", parents=[common],
                        help="convention audit: flip rates, clustering, MDS, entropy attribution",
                        description="Compare every head with every head with the sink included (FULL) and "
                                    "removed (CONTENT): which conclusions flip, whether clusters and MDS maps "
                                    "follow sink mass, and (with --compare-to) how much of an entropy change "
                                    "is sink. Writes analysis.json, report.md and figures to --out.")
    an.add_argument("model", help="shipped checkpoint name, local folder or Hub id")
    an.add_argument("--data", default="shakespeare:evaluation",
                    help="shakespeare:<split>, a local .txt file/folder, or a Hub dataset id")
    an.add_argument("--out", required=True, help="output folder (written atomically)")
    an.add_argument("--sinks", default=None,
                    help="first | bos | special | auto | ids:ID,... | positions:P,... (default by model)")
    an.add_argument("--unit", choices=("windows", "lines"), default=None,
                    help="fixed-length windows (decoder default) or one sample per non-empty line (encoder "
                         "default)")
    an.add_argument("--max-length", type=int, default=128, help="window length / max line length in tokens")
    an.add_argument("--num-samples", type=int, default=64)
    an.add_argument("--compare-to", default=None, metavar="MODEL2",
                    help="a paired state with the same tokenizer (e.g. an earlier checkpoint): attribute the "
                         "entropy change MODEL2 -> MODEL to sink and content")
    an.add_argument("--metrics", default="cosine,js", help="comma-separated pair metrics (cosine, js, hellinger, "
                                                          "tv, aitchison)")
    an.add_argument("--threshold", action="append", metavar="METRIC=T",
                    help="redundancy threshold for the verdict flip rate (default: the median FULL value)")
    an.add_argument("--clusters", type=int, default=None, help="number of clusters (default round(sqrt(heads/2)))")
    an.add_argument("--no-bos", action="store_true", help="do not start decoder windows with BOS")
    an.add_argument("--batch-size", type=int, default=8)
    an.add_argument("--chunk-size", type=int, default=128, help="query rows per chunk (memory)")
    an.add_argument("--seed", type=int, default=0)
    an.add_argument("--threads", type=int, default=None)
    an.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    an.set_defaults(func=_analyze)

    def recipe_args(p):
        p.add_argument("recipe", help="YAML recipe (see recipes/)")
        p.add_argument("--out", help="output folder (default: runs/<recipe name>[-compare])")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a recipe key, e.g. --set selection.target=0.4 (repeatable)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")

    pp = sub.add_parser("prune", parents=[common], help="calibrate, score, select, prune, evaluate, save",
                        description="Prune attention heads as a recipe says, and measure the damage.")
    recipe_args(pp)
    pp.set_defaults(func=_prune)

    cp = sub.add_parser("compare", parents=[common],
                        help="every scorer x sparsity x compensation on the same windows",
                        description="Compare scorers on one calibration pass and the same evaluation windows.")
    recipe_args(cp)
    cp.add_argument("--scorers", help="comma-separated scorer names (default: all)")
    cp.add_argument("--sparsities", default="0.1,0.25,0.4,0.5", help="comma-separated fractions or counts")
    cp.add_argument("--compensation", default="zero,mean", help="zero, mean or both (comma-separated)")
    cp.set_defaults(func=_compare)

    ep = sub.add_parser("export", parents=[common],
                        help="a shareable checkpoint of a run (dense or compact) + model card; push",
                        description="Rebuild a run's pruned model from RUN_DIR (recipe.yaml, plan.json, "
                                    "compensation.safetensors), write it as a vanilla transformers checkpoint "
                                    "with a model card, check that it reloads, and optionally push it to the Hub.")
    ep.add_argument("run_dir", metavar="RUN_DIR", help="output folder of `pruner prune`")
    ep.add_argument("--format", required=True, choices=("dense", "compact"),
                    help="dense: pruned heads zeroed, original shapes, loads anywhere; compact: heads removed, "
                         "smaller (only where the config can express it)")
    ep.add_argument("--out", help="export folder (default: RUN_DIR/export-FORMAT)")
    ep.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this Hub model repo (created if needed)")
    ep.add_argument("--private", action="store_true", help="create the Hub repo as private")
    ep.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    ep.set_defaults(func=_export)
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 2 bad input (one-line message), 1 unexpected failure, 130 interrupted.

    Tracebacks are for developers: `--debug` shows them, everyone else gets one line.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("pruner: interrupted; no output folder was written", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad input: files, recipes, data, models, Hub (FileNotFoundError is an OSError)
        if args.debug:
            raise
        print(f"pruner: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug or an environment problem: still one line without --debug
        if args.debug:
            raise
        print(f"pruner: error: unexpected {type(e).__name__}: {_one_line(e)} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
