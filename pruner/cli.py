"""The `pruner` command line. Exposes only what works."""

from __future__ import annotations

import argparse
import sys

from pruner import __version__


def _sinks(args: argparse.Namespace) -> int:
    import torch

    from pruner import data, models
    from pruner.eager import eager_sink_mass, format_table

    torch.set_num_threads(args.threads) if args.threads else None
    model = models.load_model(args.model, attn_implementation="eager")
    tok = models.load_tokenizer(args.model)
    texts = data.load_texts(data.TextSource(args.data))
    if models.is_causal(model.config):
        batch = data.token_windows(tok, texts, args.length, bos=not args.no_bos,
                                   num_samples=args.num_samples, seed=args.seed)
        sink_ids, from_query = None, 16 if args.from_query is None else args.from_query  # position 0
    else:
        batch = data.line_samples(tok, texts, args.length, num_samples=args.num_samples, seed=args.seed)
        sink_ids, from_query = [tok.cls_token_id, tok.sep_token_id], args.from_query or 0
    table = eager_sink_mass(model, batch, sink_ids=sink_ids, from_query=from_query,
                            batch_size=args.batch_size)
    what = "position 0" if sink_ids is None else "[CLS]/[SEP]"
    print(f"{args.model}: mean attention to {what} (query positions >= {from_query}, "
          f"{len(batch)} samples of {args.data})")
    print(format_table(table))
    upper = table[1:].flatten()
    print(f"layers >= 1: {int((upper >= 0.3).sum())}/{upper.numel()} heads with sink mass >= 0.3; "
          f"mean {table.mean():.3f}, max {table.max():.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pruner", description="Sink-aware attention-head pruning for Hugging Face checkpoints.")
    ap.add_argument("--version", action="version", version=f"pruner {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser("sinks", help="layer x head table of attention-sink mass",
                        description="Measure how much attention each head puts on the sink: position 0 "
                                    "for decoders, [CLS]/[SEP] for encoders (eager attention maps).")
    sp.add_argument("model", nargs="?", default="minilm-causal",
                    help="shipped checkpoint name, local folder or Hub id (default: minilm-causal)")
    sp.add_argument("--data", default="shakespeare:evaluation",
                    help="shakespeare:<split>, a local .txt file/folder, or a Hub dataset id")
    sp.add_argument("--length", type=int, default=128, help="window length / max line length in tokens")
    sp.add_argument("--num-samples", type=int, default=32)
    sp.add_argument("--no-bos", action="store_true", help="do not start decoder windows with BOS")
    sp.add_argument("--from-query", type=int, default=None,
                    help="only query positions >= this (default: 16 for decoders, 0 for encoders)")
    sp.add_argument("--batch-size", type=int, default=8)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--threads", type=int, default=None)
    sp.set_defaults(func=_sinks)
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
