"""Recovery evidence: shipped decoders pruned, then recovered by `pruner recover`, measured on two held-out domains.

    python eval/recovery_study.py CONFIG [CONFIG ...] [--set KEY=VALUE ...] [--out eval/results/recovery]

A CONFIG is MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER, e.g. `llama-shakespeare:0.5:generated:131072:full:resident`
(MODEL: gpt2-shakespeare, llama-shakespeare, minilm-causal; DATA: generated or shakespeare:train); `--set` adds a
`recovery:` setting to every config (one chosen on development text, eval/recovery_dev.py). For each:

1. the run `pruner prune` makes of the model's recipe at SPARSITY with the default scorer (refit-energy), refit
   compensation and `surgery.mode: remove` (made once, kept in OUT/runs/; `selection.shape: any` so 25% stays 25%);
2. `pruner recover RUN --tokens TOKENS --data DATA --set recovery.method=METHOD --set recovery.teacher=TEACHER` in
   its own process: wall time, the child's peak resident memory, its tokens/s;
3. perplexity of the base, pruned and recovered models on `shakespeare:evaluation` and `python-docs:evaluation`
   (64 windows of 128 tokens each; neither is ever trained on) and the damage recovered
   R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base) per domain;
4. once per run: the plain training throughput of the same student without a teacher (next-token cross-entropy,
   same batch, AdamW), the denominator of the throughput target.

Appends one JSON line per config to OUT/records.jsonl and prints the markdown table of every record so far
(docs/recovery.md). CPU, one thread per process unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("shakespeare:evaluation", "python-docs:evaluation")
RECIPES = {"gpt2-shakespeare": "gpt2-shakespeare.yaml", "llama-shakespeare": "llama-shakespeare.yaml",
           "minilm-causal": "quickstart.yaml"}


def cli(args: list[str]) -> tuple[float, float]:
    """Run `pruner ARGS` in a child process; (wall seconds, the child's peak RSS in GiB)."""
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run([sys.executable, "-m", "pruner.cli", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"pruner {' '.join(args)} failed: {out.stderr[-2000:]}")
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return time.perf_counter() - t0, peak / 2**20


def run_folder(out: Path, model: str, sparsity: str) -> Path:
    folder = out / "runs" / f"{model}-{sparsity}"
    if not (folder / "metrics.json").exists():
        cli(["prune", str(ROOT / "recipes" / RECIPES[model]), "--out", str(folder), "--overwrite",
             "--set", f"selection.target={sparsity}", "--set", "selection.shape=any",
             "--set", "scorer.name=refit-energy", "--set", "surgery.compensation=refit",
             "--set", "surgery.mode=remove", "--set", "bench.enabled=false", "--set", "evaluation.latency=false"])
    return folder


def nll(model, tokenizer, domain: str) -> float:
    """Mean next-token NLL per token on 64 windows of 128 tokens of `domain`."""
    from pruner.core import data
    from pruner.evaluation.perplexity import sliding_windows, window_scores

    texts = data.load_texts(data.TextSource(domain))
    windows = sliding_windows(tokenizer, texts, 128, max_windows=64)
    total, count, _ = window_scores(model, windows, 8, causal=True)
    return float(total.sum() / count.sum())


def reference(run: Path, model: str, domains: tuple[str, ...] = DOMAINS, name: str = "reference.json",
              plain: bool = True) -> dict:
    """Base and pruned NLLs on `domains` and (`plain`) the plain-training throughput, computed once per run and
    kept in the run folder as `name`."""
    path = run / name
    if path.exists():
        return json.loads(path.read_text())
    import pruner
    from pruner.checkpoints import loading

    tok = loading.load_tokenizer(model)
    base, pruned = loading.load_model(model), pruner.load(run / "model").float()
    ref = {d: {"base": nll(base, tok, d), "pruned": nll(pruned, tok, d)} for d in domains}
    if plain:
        ref["plain_tokens_per_second"] = plain_training(pruned)
    path.write_text(json.dumps(ref, indent=1))
    return ref


def plain_training(model, steps: int = 6, batch: int = 8, length: int = 128) -> float:
    """Tokens/s of next-token cross-entropy training of `model` alone (AdamW, the recovery's batch), after a
    warm-up step: what training costs without a teacher."""
    from pruner.recovery.loss import next_token_ce

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (steps + 1, batch, length), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    mask = torch.ones(batch, length)
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        out = model(input_ids=ids[i], attention_mask=mask, use_cache=False).logits
        (next_token_ce(out, ids[i], mask) / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * batch * length / (time.perf_counter() - t0)


def one(out: Path, config: str, settings: tuple[str, ...] = ()) -> dict:
    model, sparsity, data, tokens, method, teacher = config.split(":", 5) if config.count(":") == 5 else \
        _with_colon(config)
    run = run_folder(out, model, sparsity)
    ref = reference(run, model)
    rec = out / "recovered" / "_".join([config.replace(":", "_"), *(x.replace("=", "-") for x in settings)])
    wall, peak = cli(["recover", str(run), "--out", str(rec), "--overwrite", "--tokens", tokens, "--data", data,
                      "--set", f"recovery.method={method}", "--set", f"recovery.teacher={teacher}",
                      *(x for kv in settings for x in ("--set", f"recovery.{kv}"))])
    import pruner
    from pruner.checkpoints import loading

    m = json.loads((rec / "metrics.json").read_text())["recovery"]
    recovered, tok = pruner.load(rec / "model").float(), loading.load_tokenizer(model)
    record = {"config": config, **({"settings": list(settings)} if settings else {}), "model": model, "sparsity": float(sparsity), "data": data, "tokens": int(tokens),
              "method": method, "teacher": teacher, "wall_s": round(wall, 1), "peak_rss_gib": round(peak, 2),
              "tokens_per_second": m["tokens_per_second"], "train_seconds": m["seconds"], "kept": m["kept"],
              "validation_kl": [m["validation_kl_pruned"], m["validation_kl_best"]],
              "plain_tokens_per_second": round(ref["plain_tokens_per_second"], 1)}
    for d in DOMAINS:
        record[d] = damage(ref[d]["base"], ref[d]["pruned"], nll(recovered, tok, d))
    return record


def damage(b: float, p: float, after: float) -> dict:
    """A domain's perplexities (from the base, pruned and recovered NLLs) and the damage recovered
    R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base); None where pruning did no damage."""
    return {"ppl_base": math.exp(b), "ppl_pruned": math.exp(p), "ppl_recovered": math.exp(after),
            "R": (p - after) / (p - b) if p > b else None}


def cells(d: dict) -> tuple[str, str]:
    """A `damage` record's two table cells: the perplexities base / pruned / recovered, and R."""
    return (f"{d['ppl_base']:.1f} / {d['ppl_pruned']:.1f} / {d['ppl_recovered']:.1f}",
            "n/a" if d["R"] is None else f"{d['R']:.2f}")


def _with_colon(config: str) -> tuple[str, ...]:
    """DATA may hold a colon (shakespeare:train): MODEL:SPARSITY:SRC:SPLIT:TOKENS:METHOD:TEACHER."""
    p = config.split(":")
    return (p[0], p[1], f"{p[2]}:{p[3]}", p[4], p[5], p[6])


def table(records: list[dict]) -> str:
    rows = ["| model | sparsity | data | tokens | method | teacher | ppl shakespeare base / pruned / recovered | R | "
            "ppl python-docs base / pruned / recovered | R | tokens/s (plain) | wall s | peak GiB | kept |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s, p = cells(r[DOMAINS[0]]), cells(r[DOMAINS[1]])
        data = ", ".join([r["data"], *r.get("settings", [])])
        rows.append(f"| {r['model']} | {r['sparsity']:g} | {data} | {r['tokens']:,} | {r['method']} | "
                    f"{r['teacher']} | {s[0]} | {s[1]} | {p[0]} | {p[1]} | {r['tokens_per_second']:.0f} "
                    f"({r['plain_tokens_per_second']:.0f}) | {r['wall_s']:.0f} | {r['peak_rss_gib']:.2f} | "
                    f"{r['kept']} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--out", default=str(ROOT / "eval" / "results" / "recovery"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a `recovery:` setting for every config, e.g. temperature_generate=2.0 (chosen on "
                         "development text: eval/recovery_dev.py)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for config in args.configs:
        record = one(out, config, tuple(args.set))
        with open(out / "records.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (out / "table.md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
