"""`pruner sinks`: the layer x head sink-mass table of a model, and what removing the sink does to neighbours."""

from __future__ import annotations

import argparse

from pruner.commands import sample_args, sample_options


def add_parser(sub, common) -> None:
    p = sub.add_parser("sinks", parents=[common], help="layer x head table of attention-sink mass",
                       description="How much attention each head puts on the sink (default: first token "
                                   "for decoders, [CLS]/[SEP] for encoders), and whether heads' nearest "
                                   "neighbours survive removing the sink. Streaming capture: no T x T maps.")
    p.add_argument("model", nargs="?", default="minilm-causal",
                   help="shipped checkpoint name, local folder or Hub id (default: minilm-causal)")
    sample_args(p, num_samples=32)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pruner.analysis import flips
    from pruner.api.analysis import measure_heads
    from pruner.attention.eager import format_table
    from pruner.core import distributed

    _, _, _, st, batch, unit, spec, _ = measure_heads(args.model, None, args.data, metrics=("cosine",),
                                                          progress=distributed.is_main(), **sample_options(args))
    if not distributed.is_main():  # several processes: rank 0 prints
        return 0
    print(f"\n{args.model}: sink mass per layer x head (sinks: {spec.mode}; {len(batch)} {unit} "
          f"of {args.data}, {int(st.rows[0])} query rows)")
    print(format_table(st.sink_mass))
    upper = st.sink_mass[1:].flatten()
    print(f"layers >= 1: {int((upper >= 0.3).sum())}/{upper.numel()} heads with sink mass >= 0.3; "
          f"entropy full {st.entropy_full.mean():.2f} vs content {st.entropy_content.mean():.2f} nats")
    rates = flips.nn_flip_rate(st.pairs["cosine/full"], st.pairs["cosine/content"], similarity=True)
    print("nearest neighbour by cosine, FULL vs CONTENT: agree for "
          + ", ".join(f"L{i} {1 - f:.0%}" for i, f in enumerate(rates.tolist()))
          + f" of heads (overall {1 - rates.mean():.0%})")
    return 0
