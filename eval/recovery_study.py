"""Recovery evidence: shipped decoders pruned, then recovered by `pruner recover`, measured on two held-out domains.

    python eval/recovery_study.py CONFIG [CONFIG ...] [--set KEY=VALUE ...] [--windows N|all] [--out eval/results/recovery]

A CONFIG is MODEL:SPARSITY:DATA:TOKENS:METHOD:TEACHER, e.g. `llama-shakespeare:0.5:generated:131072:full:resident`
(MODEL: gpt2-shakespeare, llama-shakespeare, minilm-causal; DATA: generated or shakespeare:train); `--set` adds a
`recovery:` setting to every config (one chosen on development text, eval/recovery_dev.py). For each:

1. the run `pruner prune` makes of the model's recipe at SPARSITY with the default scorer (refit-energy), refit
   compensation and `surgery.mode: remove` (made once, kept in OUT/runs/; `selection.shape: any` so 25% stays 25%);
2. `pruner recover RUN --tokens TOKENS --data DATA --set recovery.method=METHOD --set recovery.teacher=TEACHER` in
   its own process: wall time, the child's peak resident memory, its tokens/s;
3. perplexity of the base, pruned and recovered models on `shakespeare:evaluation` and `python-docs:evaluation`
   (the first 64 windows of 128 tokens each, or with `--windows all` every window of the split; neither is ever
   trained on) and the damage recovered R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base) per domain,
   with its 95% bootstrap interval over 64 contiguous blocks of windows (one window each at 64 windows);
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("shakespeare:evaluation", "python-docs:evaluation")
RECIPES = {"gpt2-shakespeare": "gpt2-shakespeare.yaml", "llama-shakespeare": "llama-shakespeare.yaml",
           "minilm-causal": "quickstart.yaml"}


def cli(args: list[str]) -> tuple[float, float]:
    """Run `pruner ARGS` in a child process; (wall seconds, this child's peak RSS in GiB: its own rusage, where
    RUSAGE_CHILDREN's would be the largest of every child so far)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "pruner.cli", *args], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode:
            err.seek(0)
            raise SystemExit(f"pruner {' '.join(args)} failed: {err.read()[-2000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20


def run_folder(out: Path, model: str, sparsity: str) -> Path:
    folder = out / "runs" / f"{model}-{sparsity}"
    if not (folder / "metrics.json").exists():
        cli(["prune", str(ROOT / "recipes" / RECIPES[model]), "--out", str(folder), "--overwrite",
             "--set", f"selection.target={sparsity}", "--set", "selection.shape=any",
             "--set", "scorer.name=refit-energy", "--set", "surgery.compensation=refit",
             "--set", "surgery.mode=remove", "--set", "bench.enabled=false", "--set", "evaluation.latency=false"])
    return folder


def windows(tokenizer, domain: str, count: int | None = 64):
    """The windows of 128 tokens of `domain` every model is scored on: the first `count`, or every one (None).

    The first 64 are the opening 8,192 tokens of the split — on the plays, the first scenes of one play — so
    `--windows all` measures the domain where 64 measure one stretch of it."""
    from pruner.core import data
    from pruner.evaluation.perplexity import sliding_windows

    return sliding_windows(tokenizer, data.load_texts(data.TextSource(domain)), 128, max_windows=count)


def window_count(text: str) -> int | None:
    """`--windows`: a count, or `all` (None: every window)."""
    return None if text == "all" else int(text)


def nll(model, tokenizer, domain: str, count: int | None = 64) -> float:
    """Mean next-token NLL per token on the windows of `domain` (the first `count`, or every one)."""
    total, n = window_nll(model, windows(tokenizer, domain, count))
    return sum(total) / sum(n)


def window_nll(model, w) -> tuple[list[float], list[int]]:
    """Per window of `w`: the summed next-token NLL and the number of tokens predicted."""
    from pruner.evaluation.perplexity import window_scores

    total, count, _ = window_scores(model, w, 8, causal=True)
    return total.tolist(), count.tolist()


@torch.no_grad()
def divergence(teacher, model, w, batch: int = 8) -> dict[str, list[float]]:
    """Per window of `w`, summed over the positions its NLL counts: the full-vocabulary KL(teacher || model) and
    the entropies (nats) of the model and of the teacher."""
    kl, ent, ent_t = [], [], []
    model.eval()
    for i in range(0, len(w), batch):
        ids, mask = w.input_ids[i:i + batch], w.attention_mask[i:i + batch]
        on = (w.labels[i:i + batch, 1:] != -100).double()                          # (b, T-1)
        t = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        s = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)  # (b, T-1, V)
        kl += ((t.exp() * (t - s)).sum(-1).double() * on).sum(-1).tolist()
        ent += ((-(s.exp() * s).sum(-1)).double() * on).sum(-1).tolist()
        ent_t += ((-(t.exp() * t).sum(-1)).double() * on).sum(-1).tolist()
    return {"kl": kl, "entropy": ent, "entropy_teacher": ent_t}


def reference_path(run: Path, count: int | None = 64, name: str = "reference.json") -> Path:
    """Where a run keeps its `reference` for `count` windows: `name` for 64, `reference-all.json` for every one."""
    return run / (name if count == 64 else name.replace(".json", f"-{count or 'all'}.json"))


def reference(run: Path, model: str, domains: tuple[str, ...] = DOMAINS, name: str = "reference.json",
              plain: bool = True, count: int | None = 64) -> dict:
    """Base and pruned NLLs on `domains` (means, and per window with the pruned model's KL to the base) and
    (`plain`) the plain-training throughput, computed once per run and kept in the run folder
    (`reference_path`)."""
    path = reference_path(run, count, name)
    kept = json.loads(path.read_text()) if path.exists() else {}
    if kept and all("windows" in kept.get(d, {}) for d in domains) and (not plain or "plain_tokens_per_second" in kept):
        return kept
    import pruner
    from pruner.checkpoints import loading

    tok = loading.load_tokenizer(model)
    base, pruned = loading.load_model(model).float(), pruner.load(run / "model").float()
    ref = {}
    for d in domains:
        w = windows(tok, d, count)
        (b, n), (p, _) = window_nll(base, w), window_nll(pruned, w)
        div = divergence(base, pruned, w)
        ref[d] = {"base": sum(b) / sum(n), "pruned": sum(p) / sum(n),
                  "windows": {"count": n, "base": b, "pruned": p, "kl_pruned": div["kl"],
                              "entropy_pruned": div["entropy"], "entropy_base": div["entropy_teacher"]}}
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


def one(out: Path, config: str, settings: tuple[str, ...] = (), count: int | None = 64) -> dict:
    model, sparsity, data, tokens, method, teacher = config.split(":", 5) if config.count(":") == 5 else \
        _with_colon(config)
    run = run_folder(out, model, sparsity)
    ref = reference(run, model, count=count)
    rec = out / "recovered" / "_".join([config.replace(":", "_"), *(x.replace("=", "-") for x in settings)])
    wall, peak = cli(["recover", str(run), "--out", str(rec), "--overwrite", "--tokens", tokens, "--data", data,
                      "--set", f"recovery.method={method}", "--set", f"recovery.teacher={teacher}",
                      *(x for kv in settings for x in ("--set", f"recovery.{kv}"))])
    import pruner
    from pruner.checkpoints import loading

    m = json.loads((rec / "metrics.json").read_text())["recovery"]
    recovered, tok = pruner.load(rec / "model").float(), loading.load_tokenizer(model)
    base = loading.load_model(model).float()
    record = {"config": config, **({"settings": list(settings)} if settings else {}), "model": model, "sparsity": float(sparsity), "data": data, "tokens": int(tokens),
              "method": method, "teacher": teacher, "wall_s": round(wall, 1), "peak_rss_gib": round(peak, 2),
              "tokens_per_second": m["tokens_per_second"], "train_seconds": m["seconds"], "kept": m["kept"],
              "validation_kl": [m["validation_kl_pruned"], m["validation_kl_best"]],
              "validation_history": m.get("validation_history"), "restarts": m.get("restarts", []),
              "plain_tokens_per_second": round(ref["plain_tokens_per_second"], 1),
              **({} if count == 64 else {"windows": count or "all"})}
    for d in DOMAINS:
        w = windows(tok, d, count)
        total, _ = window_nll(recovered, w)
        record[d] = held_out(ref[d]["windows"], total, divergence(base, recovered, w))
    return record


def damage(b: float, p: float, after: float) -> dict:
    """A domain's perplexities (from the base, pruned and recovered NLLs) and the damage recovered
    R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base); None where pruning did no damage."""
    return {"ppl_base": math.exp(b), "ppl_pruned": math.exp(p), "ppl_recovered": math.exp(after),
            "R": (p - after) / (p - b) if p > b else None}


def blocks(x: list[float], units: int = 64) -> np.ndarray:
    """Per-window sums summed over `units` contiguous blocks of windows (one window each where there are 64):
    the bootstrap's resampling unit, so that neighbouring windows of one scene are not counted as independent."""
    return np.asarray([c.sum() for c in np.array_split(np.asarray(x, dtype=float), min(units, len(x)))])


def held_out(ref: dict, total: list[float], div: dict[str, list[float]], resamples: int = 2000) -> dict:
    """A domain's `damage` record from per-window sums (`ref`: the reference's `windows`; `total`: the recovered
    model's NLL sums; `div`: its KL to the teacher and entropy), with R's 95% paired bootstrap interval over 64
    contiguous blocks of windows, the KL(teacher || model) per token of the pruned and recovered models on this
    text and the share of it recovery removed (R_KL = 1 - KL_recovered / KL_pruned: distillation's own objective,
    measured held out), and the entropies of base, pruned and recovered."""
    n = sum(ref["count"])
    base, pruned, after = (sum(x) / n for x in (ref["base"], ref["pruned"], total))
    out = damage(base, pruned, after)
    b, p, a = (blocks(x) for x in (ref["base"], ref["pruned"], total))
    idx = np.random.default_rng(0).integers(0, len(b), (resamples, len(b)))           # (resample, block)
    gap = p[idx].sum(1) - b[idx].sum(1)
    r = (p[idx].sum(1) - a[idx].sum(1))[gap > 0] / gap[gap > 0]
    kl_p, kl_r = sum(ref["kl_pruned"]) / n, sum(div["kl"]) / n
    out.update({"R_ci": [float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))] if out["R"] is not None
                else None,
                "kl_pruned": kl_p, "kl_recovered": kl_r, "R_kl": 1 - kl_r / kl_p,
                "entropy": [sum(ref["entropy_base"]) / n, sum(ref["entropy_pruned"]) / n, sum(div["entropy"]) / n]})
    return out


def cells(d: dict) -> tuple[str, str]:
    """A `damage` record's two table cells: the perplexities base / pruned / recovered, and R (with its 95%
    interval where measured)."""
    ci = f" [{d['R_ci'][0]:.2f}, {d['R_ci'][1]:.2f}]" if d.get("R_ci") else ""
    return (f"{d['ppl_base']:.1f} / {d['ppl_pruned']:.1f} / {d['ppl_recovered']:.1f}",
            "n/a" if d["R"] is None else f"{d['R']:.2f}{ci}")


def kl_cell(d: dict) -> str:
    """KL(teacher || model) per token, pruned -> recovered, and R_KL; a dash for records made before they were."""
    return f"{d['kl_pruned']:.4f} → {d['kl_recovered']:.4f} ({d['R_kl']:.2f})" if "R_kl" in d else "—"


def _with_colon(config: str) -> tuple[str, ...]:
    """DATA may hold a colon (shakespeare:train): MODEL:SPARSITY:SRC:SPLIT:TOKENS:METHOD:TEACHER."""
    p = config.split(":")
    return (p[0], p[1], f"{p[2]}:{p[3]}", p[4], p[5], p[6])


def table(records: list[dict]) -> str:
    rows = ["| model | sparsity | data | tokens | method | teacher | ppl shakespeare base / pruned / recovered | R | "
            "KL to teacher (R_KL) | ppl python-docs base / pruned / recovered | R | KL to teacher (R_KL) | "
            "tokens/s (plain) | wall s | peak GiB | kept |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s, p = cells(r[DOMAINS[0]]), cells(r[DOMAINS[1]])
        data = ", ".join([r["data"], *r.get("settings", [])])
        rows.append(f"| {r['model']} | {r['sparsity']:g} | {data} | {r['tokens']:,} | {r['method']} | "
                    f"{r['teacher']} | {s[0]} | {s[1]} | {kl_cell(r[DOMAINS[0]])} | {p[0]} | {p[1]} | "
                    f"{kl_cell(r[DOMAINS[1]])} | {r['tokens_per_second']:.0f} "
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
    ap.add_argument("--windows", type=window_count, default=64, help="how many of each held-out split's windows "
                    "of 128 tokens to score, from its start, or `all` (default 64, the figures before 2026-12-04)")
    args = ap.parse_args()
    count = args.windows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for config in args.configs:
        record = one(out, config, tuple(args.set), count)
        with open(out / "records.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (out / "table.md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
