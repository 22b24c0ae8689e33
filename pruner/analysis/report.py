"""Results of `pruner analyze` for humans: report.md and the figures it links.

Reads only the analysis dict (what analysis.json holds), so a report can be
redrawn from a saved analysis.json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pruner.core.tables import markdown_table

FIGURES = {"sink_mass": "sink_mass.png", "entropy": "entropy.png", "flip_rates": "flip_rates.png",
           "attribution": "entropy_attribution.png"}
CONV_LABEL = {"full": "sink included (FULL)", "content": "sink removed (CONTENT)"}


def mds_figure(metric: str) -> str:
    return f"mds_{metric}.png"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def plot_sink_mass(res: dict, path: Path) -> None:
    plt = _plt()
    s = np.asarray(res["heads"]["sink_mass"])  # (layer, head)
    L, H = s.shape
    fig, ax = plt.subplots(figsize=(max(4.5, 0.5 * H + 2), max(2.5, 0.45 * L + 1.5)))
    im = ax.imshow(s, vmin=0, vmax=1, cmap="magma", aspect="auto")
    if L * H <= 300:
        for (i, j), v in np.ndenumerate(s):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    ax.set_title(f"{res['model']}: sink mass per head")
    fig.colorbar(im, ax=ax, label="sink mass")
    _save(fig, path)


def plot_entropy(res: dict, path: Path) -> None:
    plt = _plt()
    h = res["heads"]
    full, content, s = (np.asarray(h[k]) for k in ("entropy_full", "entropy_content", "sink_mass"))
    L, H = full.shape
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(L * H)
    a.plot(x, full.flatten(), "o-", ms=3, lw=0.8, label="full row (sink included)")
    a.plot(x, content.flatten(), "s-", ms=3, lw=0.8, label="content (sink removed)")
    for i in range(1, L):
        a.axvline(i * H - 0.5, color="grey", lw=0.5)
    a.set_xticks([i * H + (H - 1) / 2 for i in range(L)], [f"L{i}" for i in range(L)])
    a.set_ylabel("mean entropy (nats)")
    a.set_title("entropy per head (heads in layer order)")
    a.legend(fontsize=8)
    sc = b.scatter(full.flatten(), content.flatten(), c=s.flatten(), cmap="viridis", vmin=0, vmax=1, s=18)
    lim = [0, max(full.max(), content.max()) * 1.05]
    b.plot(lim, lim, color="grey", lw=0.6, ls="--")
    b.set_xlabel("full-row entropy")
    b.set_ylabel("content entropy")
    b.set_title("full vs content entropy, coloured by sink mass")
    fig.colorbar(sc, ax=b, label="sink mass")
    _save(fig, path)


def plot_mds(res: dict, metric: str, path: Path) -> None:
    plt = _plt()
    c = res["clustering"][metric]
    s = np.asarray(res["heads"]["sink_mass"])
    L, H = s.shape
    layer = np.repeat(np.arange(L), H)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, conv in zip(axes, ("full", "content")):
        xy = np.asarray(c[conv]["mds"]).reshape(-1, 2)
        sc = ax.scatter(xy[:, 0], xy[:, 1], c=s.flatten(), cmap="viridis", vmin=0, vmax=1, s=30)
        for (px, py), li in zip(xy, layer):
            ax.annotate(str(li), (px, py), fontsize=6, xytext=(2, 2), textcoords="offset points")
        r, big_r = c[conv]["mds_axis1_vs_sink_mass"]["pearson"], c[conv]["mds_plane_vs_sink_mass_r"]
        ax.set_title(f"{CONV_LABEL[conv]}\nsink mass vs axis 1: r = {_fmt(r)}, vs both axes: R = {_fmt(big_r)}",
                     fontsize=10)
        ax.set_xlabel("MDS axis 1")
        ax.set_ylabel("MDS axis 2")
    fig.colorbar(sc, ax=list(axes), label="sink mass")
    fig.suptitle(f"{res['model']}: MDS of heads by {metric} ({c['distance']}), labels = layer; "
                 f"ARI of the two clusterings {c['ari']:.2f}", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_flip_rates(res: dict, path: Path) -> None:
    plt = _plt()
    metrics = list(res["audit"])
    kinds = [("nn_flip_rate", "nearest neighbour"), ("pair_order_flip_rate", "pair order"),
             ("verdict_flip_rate", "verdict")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 3.8), squeeze=False, sharey=True)
    for ax, m in zip(axes[0], metrics):
        a = res["audit"][m]
        L = len(a["per_layer"]["nn_flip_rate"])
        x = np.arange(L)
        for k, (key, label) in enumerate(kinds):
            bars = ax.bar(x + (k - 1) * 0.27, a["per_layer"][key], width=0.27, label=label)
            ax.axhline(a["overall"][key], color=bars.patches[0].get_facecolor(), ls="--", lw=1)
        ax.set_xticks(x, [f"L{i}" for i in x])
        ax.set_ylim(0, 1)
        ax.set_title(f"{m}: within each layer (bars), whole model (dashed)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("share that flips, FULL vs CONTENT")
    axes[0][0].legend(fontsize=8)
    _save(fig, path)


def plot_attribution(res: dict, path: Path) -> None:
    plt = _plt()
    att = res["entropy_attribution"]
    per, ov = att["per_layer"], att["overall"]
    labels = [f"L{i}" for i in range(len(per["delta"]))] + ["all"]
    sink = np.asarray(per["sink_part"] + [ov["sink_part"]])
    content = np.asarray(per["content_part"] + [ov["content_part"]])
    delta = np.asarray(per["delta"] + [ov["delta"]])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels) + 2), 4))
    # stack each part away from zero on its own side so opposite signs stay visible
    ax.bar(x, sink, width=0.6, label="sink part", color="tab:red")
    ax.bar(x, content, width=0.6, bottom=np.where(np.sign(content) == np.sign(sink), sink, 0),
           label="content part", color="tab:blue")
    ax.plot(x, delta, "kD", ms=6, label="full-entropy change")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, labels)
    ax.set_ylabel("mean entropy change per head (nats)")
    ax.set_title(f"{att['reference']} -> {res['model']}: sink share {pct(ov['sink_share'])}", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)


def write_figures(res: dict, folder: Path) -> list[str]:
    """Every figure of the analysis into `folder`; returns the file names."""
    plot_sink_mass(res, folder / FIGURES["sink_mass"])
    plot_entropy(res, folder / FIGURES["entropy"])
    plot_flip_rates(res, folder / FIGURES["flip_rates"])
    names = [FIGURES["sink_mass"], FIGURES["entropy"], FIGURES["flip_rates"]]
    for m in res["clustering"]:
        if m in res["audit"]:
            plot_mds(res, m, folder / mds_figure(m))
            names.append(mds_figure(m))
    if "entropy_attribution" in res:
        plot_attribution(res, folder / FIGURES["attribution"])
        names.append(FIGURES["attribution"])
    return names


# --------------------------------------------------------------------------- report.md

def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _abs(x):
    return None if x is None else abs(x)


def summary_rows(res: dict) -> list[list]:
    """One row per metric: the overall flip rates, ARI and MDS-axis correlations."""
    rows = []
    for m, a in res["audit"].items():
        o, c = a["overall"], res["clustering"][m]
        rows.append([m, pct(o["nn_flip_rate"]), pct(o["pair_order_flip_rate"]),
                     f"{pct(o['verdict_flip_rate'])} (t = {a['threshold']:.3g})",
                     f"{pct(o['redundant_share_full'])} -> {pct(o['redundant_share_content'])}",
                     _fmt(c["ari"]),
                     _fmt(c["full"]["mds_axis1_vs_sink_mass"]["pearson"]) + " / "
                     + _fmt(c["content"]["mds_axis1_vs_sink_mass"]["pearson"]),
                     _fmt(c["full"]["mds_axis1_vs_sink_mass"]["spearman"]) + " / "
                     + _fmt(c["content"]["mds_axis1_vs_sink_mass"]["spearman"]),
                     _fmt(c["full"]["mds_plane_vs_sink_mass_r"]) + " / "
                     + _fmt(c["content"]["mds_plane_vs_sink_mass_r"]),
                     _fmt(c["full"]["sink_mass_eta2"]) + " / " + _fmt(c["content"]["sink_mass_eta2"])])
    return rows


SUMMARY_HEADER = ["metric", "NN flip", "pair-order flip", "verdict flip", "redundant FULL -> CONTENT", "ARI",
                  "MDS axis 1 ~ sink, Pearson FULL / CONTENT", "Spearman FULL / CONTENT",
                  "both MDS axes ~ sink, R FULL / CONTENT",
                  "sink variance explained by clusters FULL / CONTENT"]


def _findings(res: dict) -> list[str]:
    """Plain sentences, each carrying its numbers."""
    out = []
    s = np.asarray(res["heads"]["sink_mass"])
    out.append(f"Sink mass: mean {s.mean():.2f}, range {s.min():.2f}-{s.max():.2f} over {s.size} heads "
               f"(per layer: " + ", ".join(f"L{i} {v:.2f}" for i, v in enumerate(s.mean(1))) + ").")
    for m, a in res["audit"].items():
        o, c = a["overall"], res["clustering"][m]
        rf = _abs(c["full"]["mds_axis1_vs_sink_mass"]["pearson"])
        rc = _abs(c["content"]["mds_axis1_vs_sink_mass"]["pearson"])
        pf, pc = c["full"]["mds_plane_vs_sink_mass_r"], c["content"]["mds_plane_vs_sink_mass_r"]
        out.append(
            f"{m}: removing the sink gives {pct(o['nn_flip_rate'])} of heads a different nearest neighbour "
            f"(among all heads of the model), reverses the order of {pct(o['pair_order_flip_rate'])} of the pairs "
            f"of head pairs, and changes the \"redundant\" verdict ({a['redundant_if']} {a['threshold']:.3g}) of "
            f"{pct(o['verdict_flip_rate'])} of head pairs ({pct(o['redundant_share_full'])} redundant with the "
            f"sink, {pct(o['redundant_share_content'])} without). The two clusterings agree with ARI "
            f"{c['ari']:.2f} (1 = identical, 0 = chance); the leading MDS axis follows sink mass with "
            f"r = {_fmt(rf)} with the sink included and r = {_fmt(rc)} with it removed, and the position in the "
            f"map (both axes) with R = {_fmt(pf)} and R = {_fmt(pc)}; the clusters explain "
            f"{pct(c['full']['sink_mass_eta2'])} and {pct(c['content']['sink_mass_eta2'])} of the variance of "
            "sink mass"
            + (" -- the sink-included map is largely a map of sink size." if pf is not None and pc is not None
               and pf >= 0.7 and pf - pc >= 0.2 else "."))
    e = res["entropy"]
    rho = e["full_vs_sink_mass_spearman"]
    out.append(f"Entropy: {e['mean_full']:.2f} nats per head on full rows, {e['mean_content']:.2f} on content "
               f"rows. Across heads, full-row entropy follows sink mass with Spearman {_fmt(rho)} and content "
               f"entropy with {_fmt(e['content_vs_sink_mass_spearman'])}"
               + (" -- a low full-row entropy mostly marks a big sink, not a focused content pattern."
                  if rho is not None and rho <= -0.7 else "."))
    if "entropy_attribution" in res:
        ov = res["entropy_attribution"]["overall"]
        out.append(
            f"Entropy change {res['entropy_attribution']['reference']} -> {res['model']}: "
            f"{ov['delta']:+.3f} nats per head on average (full entropy {ov['entropy_full_reference']:.2f} -> "
            f"{ov['entropy_full']:.2f}, sink mass {ov['sink_mass_reference']:.2f} -> {ov['sink_mass']:.2f}); "
            f"sink part {ov['sink_part']:+.3f}, content part {ov['content_part']:+.3f}: "
            f"**{pct(ov['sink_share'])} of the change is sink**.")
    return out


def report_markdown(res: dict, figures: list[str]) -> str:
    d = res["data"]
    lines = [f"# pruner analyze: {res['model']}", "",
             f"{d['samples']} {d['unit']} of `{d['source']}` (max {d['max_length']} tokens, seed {d['seed']}), "
             f"sinks `{res['sinks']['mode']}`; {d['query_rows']} query rows per head "
             f"({d['excluded_rows']} with < 2 content keys left out of content statistics). "
             f"{res['n_layers']} layers x {res['n_heads']} heads, every head compared with every head.", "",
             "## Key findings", ""]
    lines += [f"- {f}" for f in _findings(res)]
    lines += _flip_section(res)
    lines += ["## Clustering and MDS maps", "",
              f"{res['clustering']['linkage'].capitalize()}-linkage clustering into "
              f"{res['clustering']['n_clusters']} clusters and metric MDS of all heads on the precomputed "
              "distances, once per convention; points coloured by sink mass.", ""]
    for m in res["audit"]:
        lines += [f"![MDS {m}]({mds_figure(m)})", ""]
    lines += ["## Sink mass and entropy", "", "![sink mass](sink_mass.png)", "", "![entropy](entropy.png)", ""]
    if "entropy_attribution" in res:
        lines += _attribution_section(res)
    lines += ["Files: `analysis.json` (every number above), " + ", ".join(f"`{f}`" for f in figures) + "."]
    return "\n".join(lines) + "\n"


def _flip_section(res: dict) -> list[str]:
    """Which conclusions flip with the convention: the whole-model table, then each metric's per-layer table."""
    lines = ["", "## Which conclusions flip with the convention", "",
              "Whole model (every head against every head); the verdict threshold is "
              + "; ".join(f"{m}: {a['threshold']:.3g} ({a['threshold_rule']})" for m, a in res["audit"].items())
              + ". MDS-axis correlations are signed after orienting axis 1 to correlate positively with sink mass "
                "under Pearson, so their size is what matters.", "",
              markdown_table(SUMMARY_HEADER, summary_rows(res)), "",
              "Within each layer:", ""]
    for m, a in res["audit"].items():
        p = a["per_layer"]
        lines += [f"**{m}**", "", markdown_table(
            ["layer", "NN flip", "pair-order flip", "verdict flip", "redundant FULL -> CONTENT"],
            [[i, pct(p["nn_flip_rate"][i]), pct(p["pair_order_flip_rate"][i]), pct(p["verdict_flip_rate"][i]),
              f"{pct(p['redundant_share_full'][i])} -> {pct(p['redundant_share_content'][i])}"]
             for i in range(res["n_layers"])]), ""]
    lines += ["![flip rates](flip_rates.png)", ""]
    return lines


def _attribution_section(res: dict) -> list[str]:
    """The entropy attribution against the reference model: per layer and overall, sink part vs content part."""
    att = res["entropy_attribution"]
    per, ov = att["per_layer"], att["overall"]
    return [f"## Entropy attribution: {att['reference']} -> {res['model']}", "",
           "Exact split of the change of each head's mean entropy into a sink part (sink mass and "
           "within-sink spread) and a content part (spread over content tokens), docs/design.md §4; "
           "layers and the whole model are means over heads.", "",
           markdown_table(["layer", "full-entropy change", "sink part", "content part", "sink share"],
                          [[i, f"{per['delta'][i]:+.3f}", f"{per['sink_part'][i]:+.3f}",
                            f"{per['content_part'][i]:+.3f}", pct(per["sink_share"][i])]
                           for i in range(len(per["delta"]))]
                          + [["all", f"{ov['delta']:+.3f}", f"{ov['sink_part']:+.3f}",
                              f"{ov['content_part']:+.3f}", pct(ov["sink_share"])]]), "",
           "![entropy attribution](entropy_attribution.png)", ""]
