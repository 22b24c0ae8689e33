"""The convention audits (issue 6): `pruner analyze` on the shipped models, then the summary table of
eval/results/studies/analyze.md (docs/convention-audit.md).

    python -m eval.studies.analyze               # the six runs, then the table (8 min 20 s on 2 cores)
    python -m eval.studies.analyze --table-only  # the table again from runs/analyze/

Runs, one CPU thread each, into runs/analyze/RUN/ (analysis.json, report.md, figures): the all-MiniLM-L6-v2
encoder on 256 lines with every special token ([CLS]/[SEP]) as a sink; the causal all-MiniLM-L6-v2 and the two
from-scratch decoders on 64 windows of 128 tokens, the first token as the sink; and two paired states, the same
windows through the state before and after (`--compare-to`). Prints the flip rates, ARI and MDS-axis
correlations per run and metric (FULL / CONTENT), then the entropy attribution of the paired states; writes
nothing under eval/results (analyze.md is written by hand from this output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from eval.common import ROOT

OUT = ROOT / "runs" / "analyze"
WINDOWS = ("--num-samples", "64", "--max-length", "128")
RUNS = {  # run name -> `pruner analyze` arguments
    "minilm": ("minilm", "--sinks", "special", "--unit", "lines", "--num-samples", "256", "--max-length", "128"),
    "minilm-causal": ("minilm-causal", *WINDOWS),
    "gpt2-shakespeare": ("gpt2-shakespeare", *WINDOWS),
    "llama-shakespeare": ("llama-shakespeare", *WINDOWS),
    "minilm-causal-vs-init": ("minilm-causal", "--compare-to", "minilm-causal-init", *WINDOWS),
    "llama-vs-early": ("llama-shakespeare", "--compare-to", "llama-shakespeare-early", *WINDOWS),
}
PAIRED = ("minilm-causal-vs-init", "llama-vs-early")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _both(c: dict, key: str) -> str:
    """A clustering statistic FULL / CONTENT."""
    return f"{_f(c['full'][key])} / {_f(c['content'][key])}"


def _axis(c: dict, kind: str) -> str:
    """The leading MDS axis against sink mass (`pearson` or `spearman`), FULL / CONTENT."""
    return f"{_f(c['full']['mds_axis1_vs_sink_mass'][kind])} / {_f(c['content']['mds_axis1_vs_sink_mass'][kind])}"


def audit_rows(out: Path) -> list[str]:
    rows = ["| run | metric | NN flip | pair-order flip | verdict flip (t) | ARI | axis 1 ~ sink r FULL / CONTENT "
            "| Spearman FULL / CONTENT | both axes R FULL / CONTENT | eta2 FULL / CONTENT |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for run in RUNS:
        r = json.loads((out / run / "analysis.json").read_text())
        for m, a in r["audit"].items():
            o, c = a["overall"], r["clustering"][m]
            rows.append(f"| {run} | {m} | {_f(o['nn_flip_rate'])} | {_f(o['pair_order_flip_rate'])} | "
                        f"{_f(o['verdict_flip_rate'])} ({a['threshold']:.3f}) | {_f(c['ari'])} | "
                        f"{_axis(c, 'pearson')} | {_axis(c, 'spearman')} | {_both(c, 'mds_plane_vs_sink_mass_r')} | "
                        f"{_both(c, 'sink_mass_eta2')} |")
    return rows


def attribution_lines(out: Path) -> list[str]:
    lines = []
    for run in PAIRED:
        r = json.loads((out / run / "analysis.json").read_text())
        ov, per = r["entropy_attribution"]["overall"], r["entropy_attribution"]["per_layer"]
        lines.append(f"{run}: dH {ov['delta']:+.4f} = sink {ov['sink_part']:+.4f} + content {ov['content_part']:+.4f}, "
                     f"sink share {_f(ov['sink_share'])}; full entropy {ov['entropy_full_reference']:.3f} -> "
                     f"{ov['entropy_full']:.3f}, sink mass {ov['sink_mass_reference']:.3f} -> {ov['sink_mass']:.3f}; "
                     "per layer sink share " + ", ".join(_f(x) for x in per["sink_share"]))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-only", action="store_true", help="print the table from the runs already made")
    args = ap.parse_args()
    if not args.table_only:
        for run, argv in RUNS.items():
            subprocess.run([sys.executable, "-m", "pruner.cli", "analyze", *argv, "--out", str(OUT / run),
                            "--threads", "1", "--overwrite"], check=True)
    print("\n".join(audit_rows(OUT) + [""] + attribution_lines(OUT)))


if __name__ == "__main__":
    main()
