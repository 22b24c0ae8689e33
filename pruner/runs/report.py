"""Results for humans: tables, plots, and the files written next to every run."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pruner.core.tables import change_cell, markdown_table
from pruner.evaluation.accuracy import accuracy_table
from pruner.evaluation.bench import BenchResult
from pruner.runs.recipe import Recipe


def _json_default(o):
    """Tensors and arrays as lists; anything else json cannot write (paths, dtypes) as its string."""
    return o.tolist() if hasattr(o, "tolist") else str(o)


def to_jsonable(x):
    """`x` as plain JSON values (what metrics.json holds): a round trip through json with `_json_default`."""
    return json.loads(json.dumps(x, default=_json_default))


def metrics_json(metrics: dict) -> str:
    """The text of a run's metrics.json, the same for a pruned run and a recovered one."""
    return json.dumps(to_jsonable(metrics), indent=1) + "\n"


def _variants(records: list[dict]) -> list[str]:
    """The selection axes a comparison varies besides scorer and sparsity (`budget`, `gqa`)."""
    return [k for k in ("budget", "gqa") if len({r.get(k) for r in records}) > 1]


def row_label(r: dict, variants: list[str]) -> str:
    """`scorer`, or `scorer (layer budget, gqa group)` when the comparison varies those axes."""
    extra = ", ".join(f"{r[k]} budget" if k == "budget" else f"gqa {r[k]}" for k in variants)
    return f"{r['scorer']} ({extra})" if extra else r["scorer"]


def compensations(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["compensation"] for r in records))


def _grid(records: list[dict], cell) -> tuple[list[str], list[list]]:
    """Rows: scorer (x budget x GQA mode when compared); columns: compensation x sparsity; `cell(record)`
    fills each cell (n/a where the plan failed)."""
    sparsities = sorted({r["sparsity"] for r in records})
    comps = compensations(records)
    variants = _variants(records)
    labels = list(dict.fromkeys(row_label(r, variants) for r in records))
    at = {(row_label(r, variants), r["sparsity"], r["compensation"]): r for r in records}
    header = ["scorer"] + [f"{c} @ {s:g}" for c in comps for s in sparsities]
    rows = []
    for label in labels:
        row = [label]
        for c in comps:
            for s in sparsities:
                r = at.get((label, s, c))
                row.append("n/a" if r is None or "error" in r else cell(r))
        rows.append(row)
    return header, rows


def compare_table(records: list[dict]) -> str:
    """Perplexity: rows scorer, columns compensation x sparsity, cells +dPPL [CI]; then one accuracy table
    per task and metric (with evaluation.tasks)."""
    header, rows = _grid(records, lambda r: change_cell(r))
    ok = [r for r in records if "error" not in r]
    base = ok[0]["base"] if ok else float("nan")
    variants = _variants(records)
    notes = sorted({f"- n/a for {row_label(r, variants)} at {r['sparsity']:g}: {r['error']}"
                    for r in records if "error" in r})
    tables = task_tables(records)
    return (f"base perplexity {base:.2f}; cells: perplexity change [95% CI]\n\n" + markdown_table(header, rows)
            + ("\n\n" + tables if tables else "") + ("\n\n" + "\n".join(notes) if notes else ""))


def task_metrics(records: list[dict]) -> list[tuple[str, str]]:
    """(task, metric) pairs the records hold, in order of first appearance."""
    return list(dict.fromkeys((t, m) for r in records for t, ms in r.get("tasks", {}).items() for m in ms))


def task_tables(records: list[dict]) -> str:
    """Per task and metric: accuracy change of every plan vs the base, same documents, bootstrap CI."""
    out = []
    for task, metric in task_metrics(records):
        def cell(r, task=task, metric=metric):
            d = r.get("tasks", {}).get(task, {}).get(metric)
            return change_cell(d, 3)

        header, rows = _grid(records, cell)
        first = next(r["tasks"][task][metric] for r in records if task in r.get("tasks", {}))
        out.append(f"{task} {metric}: base {first['base']:.3f} on {first['docs']} documents; "
                   f"cells: change [95% CI]\n\n" + markdown_table(header, rows))
    return "\n\n".join(out)


def plot_compare(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = compensations(records)
    variants = _variants(records)
    fig, axes = plt.subplots(1, len(comps), figsize=(6 * len(comps), 4.2), squeeze=False, sharey=True)
    for ax, comp in zip(axes[0], comps):
        for label in dict.fromkeys(row_label(r, variants) for r in records):
            rs = sorted((r for r in records if row_label(r, variants) == label and r["compensation"] == comp
                         and "error" not in r), key=lambda r: r["sparsity"])
            x = [100 * r["sparsity"] if r["sparsity"] < 1 else r["sparsity"] for r in rs]
            line, = ax.plot(x, [r["delta"] for r in rs], marker="o", label=label,
                            lw=2.5 if label.startswith("sink-aware") else 1.2)
            ax.fill_between(x, [r["ci_low"] for r in rs], [r["ci_high"] for r in rs],
                            color=line.get_color(), alpha=0.15)
        ax.set_title(f"compensation: {comp}")
        ax.set_xlabel("heads pruned (%)")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity change (symlog)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_compare(records: list[dict], recipe: Recipe, folder: Path) -> str:
    """compare.json, compare.csv, compare.md, compare.png and the resolved recipe."""
    (folder / "compare.json").write_text(json.dumps(records, indent=1))
    buf = io.StringIO()
    keys = ["scorer", "sparsity", "budget", "gqa", "compensation", "pruned_heads", "base", "pruned", "delta",
            "ci_low", "ci_high",
            "windows", "tokens"] + (["fidelity"] if records and "fidelity" in records[0] else []) \
        + (["unexplained", "unexplained_relative"] if any("unexplained" in r for r in records) else [])
    task_keys = [f"{t}/{m}/{k}" for t, m in task_metrics(records) for k in ("base", "pruned", "delta", "ci_low",
                                                                             "ci_high", "docs")]
    w = csv.DictWriter(buf, fieldnames=keys + task_keys, extrasaction="ignore")
    w.writeheader()
    w.writerows({**r, **{f"{t}/{m}/{k}": v for t, ms in r.get("tasks", {}).items() for m, d in ms.items()
                         for k, v in d.items()}} for r in records if "error" not in r)
    (folder / "compare.csv").write_text(buf.getvalue())
    table = compare_table(records)
    title = f"{recipe.model.path}: perplexity change vs heads pruned"
    (folder / "compare.md").write_text(f"# {title}\n\n{table}\n\n![compare](compare.png)\n")
    plot_compare(records, folder / "compare.png", title)
    (folder / "recipe.yaml").write_text(recipe.to_yaml())
    return table


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def result_table(metrics: dict, params_after: int | None = None) -> str:
    """Perplexity before/after with its CI, parameters and latency of one pruning run."""
    e = metrics["evaluation"]
    after = metrics["params_after"] if params_after is None else params_after
    return markdown_table(["", "value"], [
        ["perplexity before", e["base"]], ["perplexity after", e["pruned"]],
        ["change [95% CI]", change_cell(e)],
        ["evaluation windows / tokens", f"{e['windows']} / {e['tokens']}"],
        ["parameters", f"{metrics['params_before']:,} -> {after:,}"],
        ["latency (ms / batch)", _ms(metrics["latency_ms_before"]) + " -> " + _ms(metrics["latency_ms_after"])],
    ] + ([["embedding fidelity (cosine)", e["fidelity"]]] if "fidelity" in e else []))


def sensitivity_text(metrics: dict) -> str | None:
    """How many selected heads the other attention convention would change (None if not measured)."""
    sens = metrics.get("convention_sensitivity")
    if not sens:
        return None
    whose = ("of this plan" if sens.get("of_this_plan") else
             f"of a naive `cosine` redundancy plan at the same target, not of the plan pruned here, whose "
             f"scorer `{metrics['scorer']}` reads {metrics['convention']}")
    return (f"**Convention sensitivity** ({whose}): with the {sens['other']} convention instead of "
            f"{sens['convention']}, {sens['changed']} of the {metrics['pruned_heads']} selected heads would change "
            f"(only with {sens['convention']}: {sens['only_this']}; only with {sens['other']}: {sens['only_other']}).")


def refit_text(metrics: dict) -> str | None:
    """What a refit compensation left unexplained, per layer (None without a refit)."""
    fit = metrics.get("refit")
    if not fit or not fit.get("layers"):
        return None
    auto = fit["ridge"] == "auto"
    rows = [[layer, f"{v['pruned']:.4g}", f"{v['unexplained']:.4g}",
             f"{v['unexplained'] / v['pruned']:.1%}" if v["pruned"] > 0 else "n/a",
             "n/a" if v.get("relative") is None else f"{v['relative']:.3g}"]
            + ([f"{v['ridge']:g}", f"{v['heldout']:.4g}", f"{v['heldout_no_refit']:.4g}"] if auto else [])
            for layer, v in sorted(fit["layers"].items(), key=lambda kv: int(kv[0]))]
    intercept = {v["intercept"] for v in fit["layers"].values()}
    how = ("with an intercept (centred moments, the constant into the bias)" if intercept == {True} else
           "without an intercept (uncentred moments, no bias)" if intercept == {False} else
           "with an intercept where the output projection has a bias")
    ridge = (f"ridge chosen per layer by {fit.get('folds', '')}-fold cross-validation over the calibration samples, "
             "the largest within one standard error of the least held-out energy" if auto else
             f"ridge {fit['ridge']:g} x the mean diagonal")
    cv = ("; with the chosen ridge (relative; inf = no refit), the held-out folds' unexplained energy, and theirs "
          "without refit" if auto else "")
    return (f"**Refit compensation** ({fit.get('mode', 'oneshot')}, {ridge}, "
            f"{how}). Per layer, the energy the pruned heads wrote (around their mean with an intercept) and "
            "what the kept heads could not rebuild, E ||W_P x_P - W_P A^T x_K||^2 per calibration token "
            f"(the Schur complement), also relative to the residual stream's mean squared norm R_l{cv}:\n\n"
            + markdown_table(["layer", "pruned energy", "unexplained", "share unexplained", "unexplained / R_l"]
                             + (["ridge", "held-out", "held-out, no refit"] if auto else []), rows))


def plot_refit(metrics: dict, path: Path) -> bool:
    """Per-layer bar plot of the refit's pruned vs unexplained energy (relative to R_l when known)."""
    fit = metrics.get("refit")
    if not fit or not fit.get("layers"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(fit["layers"], key=int)
    rel = all(fit["layers"][k].get("residual") for k in layers)
    scale = [fit["layers"][k]["residual"] if rel else 1.0 for k in layers]
    x = range(len(layers))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.5 * len(layers)), 3.6))
    ax.bar([i - 0.2 for i in x], [fit["layers"][k]["pruned"] / s for k, s in zip(layers, scale)], 0.4,
           label="pruned heads' energy")
    ax.bar([i + 0.2 for i in x], [fit["layers"][k]["unexplained"] / s for k, s in zip(layers, scale)], 0.4,
           label="unexplained after refit")
    ax.set_xticks(list(x), layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("energy / R_l" if rel else "energy per token")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("refit compensation: what the kept heads could not rebuild", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def auto_table(auto: dict) -> str:
    """The candidates `auto` scored on the held-back calibration samples, best first (`pruner.runs.autochoice`)."""
    rows = [[f"`{c['scorer']}`", f"`{c['compensation']}`", f"{c['perplexity']:.2f}", f"{c['delta']:+.2f}",
             c.get("samples", auto["samples"]), f"{c['seconds']:.1f}"] for c in auto["candidates"]]
    return "\n".join([
        "## How auto chose", "", auto["line"] + ".", "",
        f"Held-back perplexity of each candidate at the target ({auto['samples']} calibration samples never in the "
        f"sums, {auto['tokens']} tokens; the unpruned model {auto['base']:.2f}); best first: those scored on every "
        "held-back sample, then those dropped after the first quarter (change against the unpruned model on the "
        "same samples):", "",
        markdown_table(["scorer", "compensation", "perplexity", "change", "samples", "seconds"], rows)])


def plan_table(plan: dict) -> str:
    """The pruned heads in selection order (`plan` as in plan.json)."""
    return markdown_table(
        ["step", "layer", "head", "score", "sink mass", "nearest twin", "twin cosine"],
        [[x["step"], x["layer"], x["head"], f"{x['score']:.4g}", x["sink_mass"], x["twin"],
          "" if x["twin_similarity"] is None else x["twin_similarity"]] for x in plan["entries"]])


def convention_phrase(metrics: dict) -> str:
    """`full convention` / `content convention` for redundancy scorers, else what the scorer reads."""
    c = metrics.get("convention")
    if not c:
        return ""
    return f"{c} convention" if c in ("full", "content") else f"reads {c}"


def run_report(metrics: dict, plan_json: str, figure: str | None = None) -> str:
    """A short report.md for one pruning run."""
    lines = [f"# pruner: {metrics['model']}", "",
             f"Pruned **{metrics['pruned_heads']} of {metrics['total_heads']} heads** with scorer "
             f"`{metrics['scorer']}`" + (f" ({convention_phrase(metrics)})" if metrics["convention"] else "")
             + f", `{metrics['compensation']}` compensation, surgery `{metrics['surgery']}`.", "",
             *([metrics["compensation_note"] + ".", ""] if metrics.get("compensation_note") else []),
             result_table(metrics), ""]
    if metrics.get("layer_by_layer"):
        lines += [f"Layer by layer: {metrics['layer_by_layer']}.", ""]
    if metrics.get("auto"):
        lines += [auto_table(metrics["auto"]), ""]
    if metrics["evaluation"].get("tasks"):
        lines += ["## Downstream tasks (same documents; bootstrap CI over documents)", "",
                  accuracy_table(metrics["evaluation"]["tasks"]), ""]
    sens = sensitivity_text(metrics)
    if sens:
        lines += [sens, ""]
    fit = refit_text(metrics)
    if fit:
        lines += [fit, ""]
        if figure:
            lines += [f"![refit]({figure})", ""]
    recovered = recovery_text(metrics)
    if recovered:
        lines += [recovered]
    if metrics.get("bench"):
        lines += ["## What the compact model buys", "", BenchResult.from_dict(metrics["bench"]).markdown(), ""]
    lines += ["## Pruned heads", "", plan_table(json.loads(plan_json))]
    return "\n".join(lines) + "\n"


def divergence_line(p: dict) -> str:
    """One sentence: KL(teacher || model) on the evaluation windows before and after recovery, and its share removed."""
    share = "" if p["kl_recovered_share"] is None else f": {p['kl_recovered_share']:.0%} of it removed"
    return (f"KL(base ‖ model) per token on the same windows: {p['kl_pruned']:.4f} (pruned) -> "
            f"{p['kl_recovered']:.4f} (recovered){share}.")


def verdict_line(p: dict) -> str:
    """One sentence on the paired change recovery made to the evaluation perplexity: beyond noise or not.

    Said, never acted on: the evaluation windows judge recovery, they do not choose its weights (the guard
    chooses on the held-back recovery windows), so a recovery that made this text worse is reported as such."""
    if p["ci_high"] < 0:
        return "Recovery lowered the evaluation perplexity beyond noise (the 95% interval is below 0)."
    if p["ci_low"] > 0:
        return ("Recovery raised the evaluation perplexity beyond noise (the 95% interval is above 0): on this text "
                "the pruned model is better; recovery data from this domain (`--data`) may serve it better.")
    return "The change recovery made to the evaluation perplexity is within noise (the 95% interval holds 0)."


def recovery_text(metrics: dict) -> str | None:
    """report.md's recovery section (None without recovery)."""
    r = metrics.get("recovery")
    if not r:
        return None
    lines = ["## Recovery (distillation from the base model)", "",
             f"`{r['method']}`, teacher `{r['teacher']}`, data `{r['data']}`, {r['tokens']:,} tokens in "
             f"{r['steps']} steps ({r['tokens_per_second']:.0f} tokens/s, {r['seconds']:.0f} s); validation KL "
             f"{r['validation_kl_pruned']:.4f} (pruned) -> {r['validation_kl_best']:.4f} (best, step "
             f"{r['best_step']}); kept: **{r['kept']}** weights.", ""]
    p = r.get("perplexity")
    if p:
        R = "n/a" if p["damage_recovered"] is None else f"{p['damage_recovered']:.2f}"
        lines += ["| | base | pruned | recovered | change by recovery [95% CI] | damage recovered R |",
                  "|---|---|---|---|---|---|",
                  f"| perplexity | {p['base']:.2f} | {p['pruned']:.2f} | {p['recovered']:.2f} | {p['delta']:+.2f} "
                  f"[{p['ci_low']:+.2f}, {p['ci_high']:+.2f}] | {R} |", "", verdict_line(p), ""]
        if p.get("kl_pruned") is not None:
            lines += [divergence_line(p), ""]
    if r.get("tasks"):
        lines += ["| task | metric | base | pruned | recovered | change by recovery [95% CI] | documents |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {task} | {metric} | {'n/a' if d['base'] is None else format(d['base'], '.4f')} | {d['pruned']:.4f} | {d['recovered']:.4f} | "
                  f"{d['delta']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}] | {d['docs']} |"
                  for task, metrics in r["tasks"].items() for metric, d in metrics.items()]
        lines += [""]
    if r.get("note"):
        lines += [r["note"], ""]
    return "\n".join(lines)
