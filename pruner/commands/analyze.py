"""`pruner analyze`: the convention audit of one model (flip rates, clustering, MDS, entropy attribution)."""

from __future__ import annotations

import argparse

from pruner.commands import resume_args, sample_args, sample_options
from pruner.core import tables


def add_parser(sub, common) -> None:
    p = sub.add_parser("analyze", parents=[common],
                       help="convention audit: flip rates, clustering, MDS, entropy attribution",
                       description="Compare every head with every head with the sink included (FULL) and "
                                   "removed (CONTENT): which conclusions flip, whether clusters and MDS maps "
                                   "follow sink mass, and (with --compare-to) how much of an entropy change "
                                   "is sink. Writes analysis.json, report.md and figures to --out.")
    p.add_argument("model", help="shipped checkpoint name, local folder or Hub id")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    sample_args(p, num_samples=64)
    p.add_argument("--compare-to", default=None, metavar="MODEL2",
                   help="a paired state with the same tokenizer (e.g. an earlier checkpoint): attribute the "
                        "entropy change MODEL2 -> MODEL to sink and content")
    p.add_argument("--metrics", default="cosine,js", help="comma-separated pair metrics (cosine, js, hellinger, "
                                                         "tv, aitchison)")
    p.add_argument("--threshold", action="append", metavar="METRIC=T",
                   help="redundancy threshold for the verdict flip rate (default: the median FULL value)")
    p.add_argument("--clusters", type=int, default=None, help="number of clusters (default round(sqrt(heads/2)))")
    p.add_argument("--chunk-size", type=int, default=128, help="query rows per chunk (memory)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    resume_args(p)
    p.add_argument("--checkpoint-every", type=float, default=600, metavar="SECONDS",
                   help="save the capture sums for --resume this often (default 600)")
    p.add_argument("--checkpoint-batches", type=int, default=None, metavar="N",
                   help="also save them every N batches")
    p.set_defaults(func=run)


def thresholds(items: list[str] | None) -> dict[str, float]:
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


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pruner import api
    from pruner.analysis import report as ar
    from pruner.core import distributed
    from pruner.runs import folders

    options = {**sample_options(args), "metrics": [m.strip() for m in args.metrics.split(",") if m.strip()],
               "thresholds": thresholds(args.threshold), "clusters": args.clusters, "chunk_size": args.chunk_size,
               "checkpoint_every_seconds": args.checkpoint_every, "checkpoint_every_batches": args.checkpoint_batches}
    out = Path(args.out)
    main = distributed.is_main()
    with folders.run_folder(out, args.overwrite, args.resume) as tmp:  # unwritable or existing: fail before compute
        if main:
            print(f"{args.model}: every head against every head on {args.data}"
                  + (f", against {args.compare_to}" if args.compare_to else ""))
        result = api.analyze(args.model, data=args.data, compare_to=args.compare_to, checkpoint_dir=tmp,
                             progress=main, **options)
        if main:
            figures = result.write(tmp)
    if not main:
        return 0
    res = result.data
    print("\n" + tables.markdown_table(ar.SUMMARY_HEADER, ar.summary_rows(res)))
    if args.compare_to:
        ov = res["entropy_attribution"]["overall"]
        print(f"\nentropy {args.compare_to} -> {args.model}: {ov['delta']:+.3f} nats per head = sink "
              f"{ov['sink_part']:+.3f} + content {ov['content_part']:+.3f} (sink share {ar.pct(ov['sink_share'])})")
    print(f"\nwrote {out}/ (analysis.json, report.md, {', '.join(figures)})")
    return 0
