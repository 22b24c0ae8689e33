#!/usr/bin/env bash
# The convention audits reported in eval/analyze_results.md (issue 6), written to runs/analyze/.
# One CPU thread per run (a shared machine).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/analyze
T=(--threads 1 --overwrite)

# all-MiniLM-L6-v2 encoder: one sample per line, [CLS]/[SEP] (every special token) as sinks
python -m pruner.cli analyze minilm --sinks special --unit lines --num-samples 256 --max-length 128 \
  --out $OUT/minilm "${T[@]}"
# causal all-MiniLM-L6-v2 and the two from-scratch decoders: 64 windows of 128 tokens, first token as sink
for m in minilm-causal gpt2-shakespeare llama-shakespeare; do
  python -m pruner.cli analyze $m --num-samples 64 --max-length 128 --out $OUT/$m "${T[@]}"
done
# paired states: the same windows through the state before and after
python -m pruner.cli analyze minilm-causal --compare-to minilm-causal-init --num-samples 64 --max-length 128 \
  --out $OUT/minilm-causal-vs-init "${T[@]}"
python -m pruner.cli analyze llama-shakespeare --compare-to llama-shakespeare-early --num-samples 64 \
  --max-length 128 --out $OUT/llama-vs-early "${T[@]}"

# the summary table of eval/analyze_results.md
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
print("| run | metric | NN flip | pair-order flip | verdict flip (t) | ARI | axis 1 ~ sink r FULL / CONTENT "
      "| Spearman FULL / CONTENT | both axes R FULL / CONTENT | eta2 FULL / CONTENT |")
print("|---|---|---|---|---|---|---|---|---|---|")
for run in ("minilm", "minilm-causal", "gpt2-shakespeare", "llama-shakespeare", "minilm-causal-vs-init",
            "llama-vs-early"):
    r = json.loads((Path(sys.argv[1]) / run / "analysis.json").read_text())
    for m, a in r["audit"].items():
        o, c = a["overall"], r["clustering"][m]
        cor = lambda k: f(c["full"]["mds_axis1_vs_sink_mass"][k]) + " / " + f(c["content"]["mds_axis1_vs_sink_mass"][k])  # noqa: E731
        print(f"| {run} | {m} | {f(o['nn_flip_rate'])} | {f(o['pair_order_flip_rate'])} | "
              f"{f(o['verdict_flip_rate'])} ({a['threshold']:.3f}) | {f(c['ari'])} | {cor('pearson')} | "
              f"{cor('spearman')} | {f(c['full']['mds_plane_vs_sink_mass_r'])} / "
              f"{f(c['content']['mds_plane_vs_sink_mass_r'])} | {f(c['full']['sink_mass_eta2'])} / "
              f"{f(c['content']['sink_mass_eta2'])} |")
print()
for run in ("minilm-causal-vs-init", "llama-vs-early"):
    r = json.loads((Path(sys.argv[1]) / run / "analysis.json").read_text())
    ov = r["entropy_attribution"]["overall"]
    per = r["entropy_attribution"]["per_layer"]
    print(f"{run}: dH {ov['delta']:+.4f} = sink {ov['sink_part']:+.4f} + content {ov['content_part']:+.4f}, "
          f"sink share {f(ov['sink_share'])}; full entropy {ov['entropy_full_reference']:.3f} -> "
          f"{ov['entropy_full']:.3f}, sink mass {ov['sink_mass_reference']:.3f} -> {ov['sink_mass']:.3f}; "
          "per layer sink share " + ", ".join(f(x) for x in per["sink_share"]))
PY
