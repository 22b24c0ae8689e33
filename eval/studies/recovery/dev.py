"""Recovery settings compared on development text only: for each, the recovery's own validation KL and the damage it
recovers on the two domains' development windows, never on their evaluation windows.

    python -m eval.studies.recovery.dev MODEL SPARSITY SETTING [SETTING ...] [--windows N|all] [--out DIR]
    python -m eval.studies.recovery.dev llama-shakespeare 0.5 32768,lr=1e-3 32768,lr=3e-4 32768,lr=1e-4  # learning rates

A SETTING is TOKENS[,KEY=VALUE...] over the `recovery:` section, e.g. `131072`, `131072,data=shakespeare:train`,
`32768,lr=3e-5`, `32768,lr=1e-3,method=lora`, `32768,lr=1e-3,restarts=0` (a learning rate alone, no restarts),
`16384,data=[shakespeare:train,python-docs:dev]` (a mixture: values are YAML, commas inside brackets stay).
The run is the one eval.studies.recovery.study prunes (default scorer refit-energy, refit, remove); each setting is
a `pruner recover RUN --tokens TOKENS --set recovery.KEY=VALUE` in its own process. Per setting: the validation KL
of the held-back slice of the recovery data (the pruned model's, after every pass, the best with its step; the
restarts), and on development text -- `shakespeare:calibration` (the plays' windows the run calibrated on: the plays
have no development split), `python-docs:dev` and `package-docs:dev` (the development splits of the docstrings and of
the packages' documentation; text a setting trains on is marked, its R is not a held-out figure) -- the damage recovered R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base)
on the first 64 windows of 128 tokens (`--windows all`: every window of the split). Appends one JSON line per
setting to OUT/dev.jsonl (default eval/results/studies/recovery) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from eval.common import RESULTS
from eval.studies.recovery.measure import DEV, cells, cli, damage, nll, reference, run_folder, window_count


def one(out: Path, model: str, sparsity: str, setting: str, count: int | None = 64) -> dict:
    tokens, *pairs = re.split(r",(?![^\[]*\])", setting)  # commas outside a YAML list
    run = run_folder(out, model, sparsity)
    ref = reference(run, model, DEV, "dev-reference.json", plain=False, count=count)  # base and pruned, once per run
    rec = out / "dev" / f"{model}-{sparsity}-{setting.replace(',', '_').replace('=', '-').replace(':', '-')}"
    sets = [x for p in pairs for x in ("--set", f"recovery.{p}")]
    wall, _ = cli(["recover", str(run), "--out", str(rec), "--overwrite", "--tokens", tokens, *sets])
    import pruner
    from pruner.checkpoints import loading

    m = json.loads((rec / "metrics.json").read_text())["recovery"]
    recovered, tok = pruner.load(rec / "model").float(), loading.load_tokenizer(model)
    row = {"model": model, "sparsity": float(sparsity), "setting": setting, "tokens": int(tokens),
           "kept": m["kept"], "validation_kl": [m["validation_kl_pruned"], m["validation_kl_best"]],
           "validation_history": m["validation_history"], "restarts": m.get("restarts", []),
           "best_step": m["best_step"], "steps": m["steps"], "tokens_per_second": m["tokens_per_second"],
           "wall_s": round(wall, 1), **({} if count == 64 else {"windows": count or "all"})}
    for d in DEV:
        row[d] = {**damage(ref[d]["base"], ref[d]["pruned"], nll(recovered, tok, d, count)),
                  **({"trained_on": True} if d in setting else {})}
    return row


def line(r: dict) -> str:
    """A row's table line: validation KL pruned -> after each pass, the best (step of steps), kept, restarts
    (step: lr), the damage recovered on each development text, tokens/s, wall time."""
    v = r["validation_kl"]
    passes = " ".join(f"{x:.4f}" for _, x in r["validation_history"][1:])
    restarts = ", ".join(f"{k}: {lr:.2g}" for k, lr in r["restarts"]) or "none"
    return (f"| {r['setting']} | {v[0]:.4f} → {passes} | {v[1]:.4f} ({r['best_step']} of {r['steps']}) | {r['kept']} | "
            f"{restarts} | {' | '.join(c for d in DEV for c in _cells(r.get(d)))} | {r['tokens_per_second']:.0f} | "
            f"{r['wall_s']:.0f} |")


def _cells(d: dict | None) -> tuple[str, str]:
    """`cells`, with R marked where the setting trained on that text, and blank for a text not measured."""
    if d is None:
        return "not measured", ""
    ppl, r = cells(d)
    return ppl, f"{r} (trained on)" if d.get("trained_on") else r


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("sparsity")
    ap.add_argument("settings", nargs="+")
    ap.add_argument("--out", default=str(RESULTS / "studies" / "recovery"))
    ap.add_argument("--windows", type=window_count, default=64, help="each development split's windows to score, "
                    "from its start: N or all")
    args = ap.parse_args()
    out, count = Path(args.out), args.windows
    print("| setting | validation KL: pruned → after each pass | best (step of steps) | kept | restarts (step: lr) | "
          "ppl plays-dev base / pruned / recovered | R | ppl docs-dev base / pruned / recovered | R | "
          "ppl package-docs-dev base / pruned / recovered | R | tokens/s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        r = one(out, args.model, args.sparsity, setting, count)
        with open(out / "dev.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(line(r), flush=True)


if __name__ == "__main__":
    main()
