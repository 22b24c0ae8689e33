"""How fast `recovery.data: generated` makes the teacher's text: the inverse-CDF draw against `torch.multinomial`
on the same probabilities, then `pruner.recovery.data.sample` of a shipped model at several batch sizes.

    python -m eval.bench.generation [--model minilm-causal] [--windows 256] [--length 128] [--batches 64 128 256]

Prints milliseconds per step of one token for 256 rows (the median of 20 after one warm-up), then the wall time
and tokens/s of sampling WINDOWS windows of LENGTH tokens at each batch size, and whether the text is the same
at every batch size (it is meant to be, up to float rounding of the logits). The torch threads are torch's
default unless OMP_NUM_THREADS says otherwise. Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pruner.checkpoints import loading
from pruner.core import assets, data
from pruner.recovery import data as rdata


def per_step_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm-causal")
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    args = ap.parse_args()
    path = assets.resolve(args.model)
    model = loading.load(path).float().eval()
    start = data.bos_token_id(loading.load_tokenizer(str(path)))  # the sink token the run's windows start with
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(256, V, generator=g)
    probs, u = torch.softmax(logits, -1), torch.rand(256, generator=g, dtype=torch.float64)
    print(f"{args.model}: vocabulary {V:,}, {torch.get_num_threads()} torch threads")
    multinomial = per_step_ms(lambda: torch.multinomial(probs, 1, generator=g))
    print(f"one token for 256 rows: torch.multinomial {multinomial:.1f} ms, "
          f"draw {per_step_ms(lambda: rdata.draw(logits, u)):.1f} ms (its softmax included)")
    texts = []
    for b in args.batches:
        t0 = time.perf_counter()
        texts.append(rdata.sample(model, start, args.windows, args.length, seed=0, batch_size=b))
        s = time.perf_counter() - t0
        print(f"sample {args.windows} x {args.length} tokens, {b} windows at a time: {s:.1f} s, "
              f"{args.windows * (args.length - 1) / s:,.0f} tokens/s")
    same = [float((t == texts[0]).all(1).float().mean()) for t in texts[1:]]
    print("windows identical to the first batch size's:", ", ".join(f"{x:.1%}" for x in same) or "n/a")


if __name__ == "__main__":
    main()
