"""What head pruning buys at real model shapes: random-weight Llama-3.2-1B, Qwen2.5-0.5B and GPT-2 small.

    python -m eval pruned                               # the table of docs/what-pruning-buys.md: the commands it runs
    python -m eval.bench.pruned --dtype-check           # every model, and GPT-2 small in float32 and bfloat16
    python -m eval.bench.pruned --models gpt2-small --repeats 1 --new-tokens 8 --out runs/smoke/pruned.json

Each model is built from its public config (`pruner.core.shapes`, `eval.common.random_model`; nothing is
downloaded)
with seeded random weights in `--dtype` (default bfloat16: on this CPU, AMX makes it
several times faster than float32; `--dtype-check` measures both). Plans: 25% and 50%
of the heads, `selection.budget` layer (the same count in every layer) and global
(any count per layer), `selection.gqa` equal (the same number of query heads removed
from every KV group, every KV head kept) and group (whole KV groups); GPT-2 has no
GQA, so only `equal`. Heads are chosen by `random` scores through the usual selection
(`pruner.evaluation.bench.weight_plan`, seed 0): which heads go does not change what removing
them buys, only how many per layer and per group.

Every variant of a model lives in one process with its base (`bench.compact_copy`
shares the weights outside q/k/v/o), and every round runs every case on the base and
on each variant in turn (`pruner.evaluation.timing.measure`), `--repeats` rounds after a warm-up
round; figures are medians, the range is that of the per-round savings. Writes
`--out` (default eval/results/bench/pruned.json) and the markdown beside it (.md), and prints the tables and the
issue's targets: realised parameter and KV-cache savings equal to the ideal, and at
least 80% of the ideal wherever the ideal time saving is >= 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from eval.common import RESULTS, command_line, random_model
from pruner.core import shapes
from pruner.core.tables import markdown_table
from pruner.evaluation import bench, timing
from pruner.pruning.selection import SelectionConfig, SelectionError

MODELS = ("llama-3.2-1b", "qwen2.5-0.5b", "gpt2-small")  # public shapes (pruner.core.shapes)
TARGETS = (0.25, 0.5)
BUDGETS = ("layer", "global")
GQA = ("equal", "group")


def checkpoint_dtype(name: str) -> torch.dtype:
    """The dtype the public checkpoint is stored in."""
    return getattr(torch, shapes.dtype_name(name))


def plans(model, targets=TARGETS, budgets=BUDGETS, gqa_modes=GQA) -> list[tuple[str, SelectionConfig]]:
    """Every target x budget x GQA mode (only `equal` without GQA: `group` would be the same plans)."""
    kv = getattr(model.config, "num_key_value_heads", None)
    gqa = gqa_modes if kv and kv != model.config.num_attention_heads else ("equal",)
    return [(f"{t:.0%} {b} {g}", SelectionConfig(target=t, budget=b, gqa=g))
            for t in targets for b in budgets for g in gqa]


def bench_model(name: str, cfg: timing.BenchConfig, dtype: torch.dtype, progress: bool, axes: dict) -> list[dict]:
    """Base + every plan's compact copy, measured together; one record per plan."""
    t0 = time.time()
    base = random_model(name, dtype)
    print(f"{name}: built in {time.time() - t0:.0f} s", flush=True)
    variants, records = {}, []
    for label, sel in plans(base, **axes):
        try:
            plan = bench.weight_plan(base, sel, seed=0)
        except SelectionError as e:
            records.append({"model": name, "plan": label, "error": str(e)})
            continue
        variants[label] = bench.compact_copy(base, plan.heads)
    load = os.getloadavg()
    t0 = time.time()
    run_plan, runs = timing.measure({"base": base, **variants}, cfg, progress)
    cond = bench.conditions(base, cfg, run_plan, load)
    cond["seconds"] = round(time.time() - t0)
    for label, model in variants.items():
        res = bench.compare(base, model, run_plan, runs["base"], runs[label], checkpoint_dtype(name), cond)
        records.append({"model": name, "plan": label, **res.to_dict()})
        print(f"\n{name}, {label}:\n{res.table()}", flush=True)
    order = [label for label, _ in plans(base, **axes)]
    return sorted(records, key=lambda r: order.index(r["plan"]))


# --------------------------------------------------------------------------- dtype check


def dtype_check(threads: int, repeats: int = 3) -> list[dict]:
    """GPT-2 small: prefill T=512 and a batch-1 decode step in float32 and in bfloat16."""
    torch.set_num_threads(threads)
    out = []
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            model = random_model("gpt2-small", dt)
            ids = torch.randint(0, 50257, (1, 513), generator=torch.Generator().manual_seed(0))
            prefill, step = [], []
            model(ids[:, :16])
            for _ in range(repeats):
                t0 = time.perf_counter()
                cache = model(ids[:, :512], use_cache=True, logits_to_keep=1).past_key_values
                t1 = time.perf_counter()
                for i in range(8):
                    cache = model(ids[:, 512:513], cache=cache, use_cache=True).past_key_values
                prefill.append(t1 - t0)
                step.append((time.perf_counter() - t1) / 8)
            out.append({"dtype": str(dt).removeprefix("torch."), "prefill_512_ms": 1000 * statistics.median(prefill),
                        "decode_step_ms": 1000 * statistics.median(step)})
            del model
    return out


# --------------------------------------------------------------------------- profile


def profile(name: str, label: str, case: str, dtype: torch.dtype, rows: int = 12) -> str:
    """Where the time goes in one case (`prefill:T` or `decode:BATCHxPROMPT`), base and one plan side by side:
    the operators by self CPU time (torch.profiler), to say why a realised saving falls short of its ideal."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    base = random_model(name, dtype)
    sel = dict(plans(base))[label]
    pruned = bench.compact_copy(base, bench.weight_plan(base, sel, seed=0).heads)
    kind, _, size = case.partition(":")
    if kind == "prefill":
        cfg = timing.BenchConfig(lengths=(int(size),), decode=(), repeats=1)
    else:
        b, p = (int(x) for x in size.split("x"))
        cfg = timing.BenchConfig(lengths=(), decode=((b, p),), new_tokens=16, repeats=1)
    out = []
    for tag, model in (("base", base), (label, pruned)):
        timing.measure({tag: model}, cfg)  # warm-up and one round outside the profiler
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            timing.measure({tag: model}, timing.BenchConfig(cfg.lengths, cfg.decode, cfg.new_tokens, repeats=1))
        out.append(f"### {name} {tag}, {case}\n\n```\n"
                   + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows) + "```")
    return "\n\n".join(out)


# --------------------------------------------------------------------------- tables


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}"


def _cell(f: dict) -> str:
    """`realised (range) / ideal`, in percent."""
    spread = f" ({100 * f['spread'][0]:.1f}..{100 * f['spread'][1]:.1f})" if f["spread"] else ""
    return f"{_pct(f['saving'])}{spread} / {100 * f['ideal']:.1f}"


def _columns(records: list[dict]) -> list[str]:
    names: list[str] = []
    for r in records:
        for f in r.get("figures", []):
            if f["name"] not in names:
                names.append(f["name"])
    return names


def savings_table(records: list[dict]) -> str:
    cols = _columns(records)
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["model"], r["plan"], "n/a"] + ["n/a"] * len(cols))
            continue
        h = r["heads"]
        by = {f["name"]: f for f in r["figures"]}
        rows.append([r["model"], r["plan"], f"{h['pruned']}/{h['total']} ({h['kv_removed']}/{h['kv_total']} KV)"]
                    + [_cell(by[c]) if c in by else "—" for c in cols])
    return markdown_table(["model", "plan", "heads removed"] + cols, rows)


def base_table(records: list[dict]) -> str:
    """The base model's absolute figures (the same in every record of a model)."""
    seen, rows = set(), []
    cols = _columns(records)
    for r in records:
        if "error" in r or r["model"] in seen:
            continue
        seen.add(r["model"])
        by = {f["name"]: f for f in r["figures"]}
        rows.append([r["model"], r["conditions"]["dtype"]]
                    + [f"{bench._fmt(by[c]['base'])} {by[c]['unit']}".strip() if c in by else "—" for c in cols])
    return markdown_table(["model", "dtype"] + cols, rows)


def target_lines(records: list[dict]) -> list[str]:
    """The issue's targets, checked: exact parameters and KV cache; >= 80% of every ideal time saving >= 10%."""
    lines, met, missed = [], 0, []
    exact = [(r["model"], r["plan"], f["name"]) for r in records if "figures" in r for f in r["figures"]
             if f["name"] in ("parameters", "KV cache") and f["saving"] != f["ideal"]]
    lines.append("parameters and KV cache equal to the ideal: " + ("all" if not exact else f"NOT {exact}"))
    for r in records:
        for f in r.get("figures", []):
            if f["spread"] is None or f["ideal"] < 0.10:
                continue
            if f["saving"] >= 0.8 * f["ideal"]:
                met += 1
            else:
                missed.append(f"{r['model']} {r['plan']} {f['name']}: {100 * f['saving']:.1f}% of an ideal "
                              f"{100 * f['ideal']:.1f}% ({f['saving'] / f['ideal']:.2f} of it)")
    lines.append(f"time savings with an ideal >= 10%: {met} reach 80% of it, {len(missed)} do not")
    return lines + [f"  missed: {m}" for m in missed]


def markdown(records: list[dict], checks: list[dict] | None) -> str:
    cond = next((r["conditions"] for r in records if "conditions" in r), {})
    text = [f"`python -m eval.bench.pruned` ({' '.join(sys.argv[1:]) or 'defaults'} in the last run); "
            f"{cond.get('device') or 'cpu'}, torch {cond.get('torch')}, transformers {cond.get('transformers')}. "
            "Per model: the conditions of its run.", ""]
    for m in dict.fromkeys(r["model"] for r in records):
        c = next((r["conditions"] for r in records if r["model"] == m and "conditions" in r), None)
        if c:
            text.append(f"- {m}: {c['dtype']}, {c['threads']} threads, {c['repeats']} interleaved rounds after a "
                        f"warm-up, prefill {c['lengths']}, decode [batch, prompt] {c['decode']} x {c['new_tokens']} "
                        f"new tokens; {c['seconds']} s, load average {c['load_average_before'][0]:.2f} before, "
                        f"{c['load_average_after'][0]:.2f} after")
    text += ["", "Base models:", "", base_table(records), "",
             "Savings, realised (range over rounds) / ideal, in percent:", "", savings_table(records), ""]
    errors = [f"- {r['model']} {r['plan']}: {r['error']}" for r in records if "error" in r]
    if errors:
        text += ["Plans that cannot be selected:", *errors, ""]
    if checks:
        text += ["dtype check (GPT-2 small, batch 1):", "",
                 markdown_table(["dtype", "prefill T=512 (ms)", "decode step (ms)"],
                                       [[c["dtype"], c["prefill_512_ms"], c["decode_step_ms"]] for c in checks]), ""]
    text += ["Targets:", "", *[f"- {line}" for line in target_lines(records)]]
    return "\n".join(text) + "\n"


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    """`1x32,8x2048` -> ((1, 32), (8, 2048))."""
    return tuple(tuple(int(v) for v in x.split("x")) for x in text.split(",") if x)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--lengths", default="512,2048", help="prefill lengths (batch 1)")
    ap.add_argument("--decode", default="1x32,8x2048", help="decode cases BATCHxPROMPT")
    ap.add_argument("--new-tokens", type=int, default=32,
                    help="tokens per decode case (the per-step time is what is measured; 32 keeps the 1B model "
                         "within the time budget)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--targets", default="0.25,0.5", help="fractions of heads to prune")
    ap.add_argument("--budgets", default="layer,global")
    ap.add_argument("--gqa", default="equal,group")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--dtype-check", action="store_true", help="also time GPT-2 small in float32 and bfloat16")
    ap.add_argument("--out", default=str(RESULTS / "bench" / "pruned.json"), help="the JSON written (the markdown "
                    "beside it, .md)")
    ap.add_argument("--append", action="store_true",
                    help="keep the other models' records already in OUT (run models one at a time)")
    ap.add_argument("--profile", metavar="MODEL:PLAN:CASE",
                    help="instead of the benchmark, profile one case, e.g. 'llama-3.2-1b:50%% layer equal:prefill:2048' "
                         "or 'gpt2-small:50%% layer equal:decode:8x895'")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        name, label, case = args.profile.split(":", 2)
        text = profile(name, label, case, getattr(torch, args.dtype))
        print(text)
        (Path(args.out).parent / f"profile-{name}-{case.replace(':', '-')}.md").write_text(text + "\n")
        return
    cfg = timing.BenchConfig(lengths=tuple(int(x) for x in args.lengths.split(",") if x), decode=_pairs(args.decode),
                            new_tokens=args.new_tokens, repeats=args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    checks = dtype_check(args.threads) if args.dtype_check else None
    if checks:
        print(json.dumps(checks), flush=True)
    records: list[dict] = []
    if args.append and out.exists():  # keep other models' records (each carries its own conditions)
        old = json.loads(out.read_text())
        records = [r for r in old["records"] if r["model"] not in args.models.split(",")]
        checks = checks or old.get("dtype_check")
    for name in args.models.split(","):
        axes = {"targets": tuple(float(x) for x in args.targets.split(",")), "budgets": tuple(args.budgets.split(",")),
                "gqa_modes": tuple(args.gqa.split(","))}
        records += bench_model(name, cfg, getattr(torch, args.dtype), progress=True, axes=axes)
        payload = {"command": command_line(), "dtype_check": checks, "records": records}
        out.write_text(json.dumps(payload, indent=1) + "\n")  # after every model
    text = markdown(records, checks)
    out.with_suffix(".md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
