"""Recovery evidence: shipped decoders pruned, then recovered by `pruner recover`, measured on two held-out domains.

    python -m eval.studies.recovery.study        # the docs' set of configs (CONFIGS below; ~20 min on 2 cores)
    python -m eval.studies.recovery.study CONFIG [CONFIG ...] [--set KEY=VALUE ...] [--windows N|all] [--out DIR]
    python -m eval.studies.recovery.study CONFIG --recovered DIR   # score a folder dev.py already recovered for CONFIG

A CONFIG is MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER, e.g. `llama-shakespeare:0.5:generated:131072:full:resident`
(MODEL: gpt2-shakespeare, llama-shakespeare, minilm-causal, gemma-3-270m; DATA: generated, a data source such as
shakespeare:train, or sources mixed in equal shares joined by `+`); `--set` adds a
`recovery:` setting to every config (one chosen on development text, eval.studies.recovery.dev). For each:

1. the run `pruner prune` makes of the model's recipe at SPARSITY with the recipe's scorer (refit-energy; Gemma's
   fluctuation), refit
   compensation and `surgery.mode: remove` (made once, kept in OUT/runs/; `selection.shape: any` so 25% stays 25%);
2. `pruner recover RUN --tokens TOKENS --data DATA --set recovery.method=METHOD --set recovery.teacher=TEACHER` in
   its own process: wall time, the child's peak resident memory, its tokens/s;
3. perplexity of the base, pruned and recovered models on `shakespeare:evaluation`, `python-docs:evaluation` and
   `package-docs:evaluation`
   (the first 64 windows of 128 tokens each, or with `--windows all` every window of the split; neither is ever
   trained on) and the damage recovered R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base) per domain,
   with its 95% bootstrap interval over 64 contiguous blocks of windows (one window each at 64 windows);
4. once per run: the plain training throughput of the same student without a teacher (next-token cross-entropy,
   same batch, AdamW), the denominator of the throughput target.

Appends one JSON line per config to OUT/records.jsonl (default eval/results/studies/recovery), writes the markdown
table of every record so far to OUT/table.md and prints it (docs/recovery.md). CPU, one thread per process unless
OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from eval.common import RESULTS
from eval.studies.recovery.measure import (
    DOMAINS,
    cells,
    cli,
    divergence,
    held_out,
    reference,
    run_folder,
    window_count,
    window_nll,
    windows,
)

CONFIGS = (  # the docs' table: MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER
    "llama-shakespeare:0.5:generated:32768:full:resident",
    "llama-shakespeare:0.5:generated:32768:full:cached",
    "llama-shakespeare:0.5:shakespeare:train:32768:full:resident",
    "llama-shakespeare:0.5:generated:32768:lora:resident",
    "llama-shakespeare:0.5:generated:32768:attention:resident",
    "llama-shakespeare:0.25:generated:32768:full:resident",
    "gpt2-shakespeare:0.5:generated:32768:full:resident",
    "llama-shakespeare:0.5:generated:131072:full:resident",
    "gpt2-shakespeare:0.5:generated:131072:full:resident",
    "minilm-causal:0.5:generated:32768:full:resident",
    "minilm-causal:0.25:generated:65536:full:resident",
)

def one(out: Path, config: str, settings: tuple[str, ...] = (), count: int | None = 64,
        recovered: Path | None = None) -> dict:
    """The config's record; `recovered`: a folder already recovered for it (`reused`), scored, not trained again."""
    model, sparsity, data, tokens, method, teacher = parse(config)
    run = run_folder(out, model, sparsity)
    ref = reference(run, model, count=count)
    if recovered is None:
        rec = out / "recovered" / "_".join([config.replace(":", "_"), *(x.replace("=", "-") for x in settings)])
        wall, peak = cli(recover_argv(run, rec, config, settings))
    else:
        rec, wall, peak = reused(recovered, run, config, settings), None, None
    import pruner
    from pruner.checkpoints import loading

    m = json.loads((rec / "metrics.json").read_text())["recovery"]
    student, tok = pruner.load(rec / "model").float(), loading.load_tokenizer(model)
    base = loading.load_model(model).float()
    record = {"config": config, **({"settings": list(settings)} if settings else {}), "model": model,
              "sparsity": float(sparsity), "data": data, "tokens": int(tokens), "method": method, "teacher": teacher,
              "wall_s": None if wall is None else round(wall, 1),
              "peak_rss_gib": None if peak is None else round(peak, 2),
              **({"reused": str(recovered)} if recovered else {}),
              "tokens_per_second": m["tokens_per_second"], "train_seconds": m["seconds"], "kept": m["kept"],
              "validation_kl": [m["validation_kl_pruned"], m["validation_kl_best"]],
              "validation_history": m.get("validation_history"), "restarts": m.get("restarts", []),
              "plain_tokens_per_second": round(ref["plain_tokens_per_second"], 1),
              **({} if count == 64 else {"windows": count or "all"})}
    for d in DOMAINS:
        w = windows(tok, d, count)
        total, _ = window_nll(student, w)
        record[d] = held_out(ref[d]["windows"], total, divergence(base, student, w))
    return record


def recover_argv(run: Path, rec: Path, config: str, settings: tuple[str, ...]) -> list[str]:
    """The `pruner recover` arguments that recover `run` into `rec` as `config` says, with `settings` set."""
    model, sparsity, data, tokens, method, teacher = parse(config)
    return ["recover", str(run), "--out", str(rec), "--overwrite", "--tokens", tokens,
            *(x for source in data.split("+") for x in ("--data", source)),
            "--set", f"recovery.method={method}", "--set", f"recovery.teacher={teacher}",
            *(x for kv in settings for x in ("--set", f"recovery.{kv}"))]


def reused(folder: Path, run: Path, config: str, settings: tuple[str, ...]) -> Path:
    """`folder`, checked to be this config's recovery of this run: the same pruned heads, and the recovery spec
    `pruner recover` would make of `recover_argv` on the run's recipe, field for field (eval.studies.recovery.dev
    recovers the study's run with the same command, so its folders qualify). One line and no record otherwise."""
    from pruner.cli import build_parser
    from pruner.commands.recover import values
    from pruner.runs.recipe_io import load_recipe
    from pruner.runs.recovery_stage import run_spec

    try:
        got, made = (json.loads((p / "metrics.json").read_text()) for p in (Path(folder), run))
    except (OSError, ValueError) as e:
        raise SystemExit(f"--recovered {folder}: not a recovered run folder ({e})") from None
    spec = (got.get("recovery") or {}).get("spec", {})
    args = build_parser().parse_args(recover_argv(run, Path(folder), config, settings))
    want = run_spec(load_recipe(run / "recipe.yaml"), values(args)).model_dump(mode="json")
    wrong = [f"{k} {spec.get(k)!r} (want {v!r})" for k, v in want.items() if spec.get(k) != v]
    if got.get("pruned_heads") != made.get("pruned_heads"):
        wrong.append(f"pruned heads differ from {run}'s")
    if wrong:
        raise SystemExit(f"--recovered {folder}: not {config}: " + "; ".join(wrong))
    return Path(folder)


def kl_cell(d: dict) -> str:
    """KL(teacher || model) per token, pruned -> recovered, and R_KL; a dash for records made before they were."""
    return f"{d['kl_pruned']:.4f} → {d['kl_recovered']:.4f} ({d['R_kl']:.2f})" if "R_kl" in d else "—"


def parse(config: str) -> tuple[str, ...]:
    """MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER, where DATA may hold colons (shakespeare:train) and name several
    sources mixed in equal shares with `+` (shakespeare:train+python-docs:dev)."""
    p = config.split(":")
    if len(p) < 6:
        raise SystemExit(f"{config}: expected MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER")
    return (p[0], p[1], ":".join(p[2:-3]), *p[-3:])


def table(records: list[dict]) -> str:
    """One row per record: per held-out domain its perplexities, R and KL (a dash for a domain a record made
    before it was scored lacks), then throughput, wall time, memory and whether recovery's model was kept."""
    names = [d.split(":")[0] for d in DOMAINS]
    rows = ["| model | sparsity | data | tokens | method | teacher | " + " | ".join(
        f"ppl {n} base / pruned / recovered | R | KL to teacher (R_KL)" for n in names) +
        " | tokens/s (plain) | wall s | peak GiB | kept |", "|---|" * (10 + 3 * len(names)) if False else
        "|" + "---|" * (10 + 3 * len(names))]
    for r in records:
        data = ", ".join([r["data"], *r.get("settings", [])])
        held = " | ".join(" | ".join([*cells(r[d]), kl_cell(r[d])]) if d in r else "— | — | —" for d in DOMAINS)
        rows.append(f"| {r['model']} | {r['sparsity']:g} | {data} | {r['tokens']:,} | {r['method']} | "
                    f"{r['teacher']} | {held} | {r['tokens_per_second']:.0f} "
                    f"({r['plain_tokens_per_second']:.0f}) | {_or_dash(r['wall_s'], '.0f')} | "
                    f"{_or_dash(r['peak_rss_gib'], '.2f')} | {r['kept']} |")
    return "\n".join(rows)


def _or_dash(x: float | None, fmt: str) -> str:
    """A figure, or a dash where a reused recovery (`--recovered`) left no wall time or memory of its own."""
    return "—" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", default=list(CONFIGS), help="default: the docs' set")
    ap.add_argument("--out", default=str(RESULTS / "studies" / "recovery"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a `recovery:` setting for every config, e.g. temperature_generate=2.0 (chosen on "
                         "development text: eval.studies.recovery.dev)")
    ap.add_argument("--windows", type=window_count, default=64, help="how many of each held-out split's windows "
                    "of 128 tokens to score, from its start, or `all` (default 64, the figures before 2026-12-04)")
    ap.add_argument("--recovered", type=Path, help="with one CONFIG: score this folder, already recovered for it "
                    "(e.g. by eval.studies.recovery.dev), instead of training again; its wall time and memory are "
                    "not re-measured")
    args = ap.parse_args()
    if args.recovered and len(args.configs) != 1:
        ap.error("--recovered scores one config's recovery: name exactly one CONFIG")
    count = args.windows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for config in args.configs:
        record = one(out, config, tuple(args.set), count, args.recovered)
        with open(out / "records.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (out / "table.md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
