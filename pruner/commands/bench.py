"""`pruner bench RUN_DIR`: what the run's compact model buys against its base, measured at full length."""

from __future__ import annotations

import argparse


def add_parser(sub, common) -> None:
    p = sub.add_parser("bench", parents=[common], help="what the pruned compact model buys: size, KV cache, "
                                                       "memory, prefill latency, decode throughput",
                       description="Load the run's base model, remove the plan's heads in a copy that shares "
                                   "every other weight, and measure both in one process, cases interleaved, "
                                   "medians of several rounds: parameters, checkpoint bytes, KV-cache bytes per "
                                   "token, peak memory, prefill latency and greedy decode throughput, each next "
                                   "to the ideal the removed heads account for. Writes RUN_DIR/bench.json and "
                                   "bench.md (or into --out).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="output folder of `pruner prune`")
    p.add_argument("--lengths", default="512,2048", help="prefill lengths at batch 1, comma-separated (capped "
                                                          "at the model's position table)")
    p.add_argument("--decode", default="1x32,8x2048", help="decode cases BATCHxPROMPT, comma-separated")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each decode case generates")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (figures are medians)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="run the models in this dtype (default: the recipe's model.dtype)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--runtime", choices=("pytorch", "onnxruntime-genai", "llama.cpp"), default="pytorch",
                   help="pytorch: both models in this process; onnxruntime-genai: both converted by ONNX Runtime "
                        "GenAI's builder (float32, CPU; the compact model must be vanilla) and timed there, each "
                        "round a fresh process per model (bench-onnxruntime-genai.json / .md); llama.cpp: both "
                        "written as GGUF (--dtype, default float16; any Llama or Mistral plan, layers may differ) "
                        "and timed in llama.cpp through llama-cpp-python, decode at batch 1, each round a fresh "
                        "process per model (bench-llama.cpp.json / .md)")
    p.add_argument("--out", help="folder for bench.json and bench.md (default: RUN_DIR)")
    p.set_defaults(func=run)


def cases(text: str) -> tuple[tuple[int, int], ...]:
    """`1x32,8x2048` -> ((1, 32), (8, 2048))."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        b, sep, p = item.partition("x")
        if not (sep and b.isdigit() and p.isdigit()):
            raise ValueError(f"--decode: {item!r} is not BATCHxPROMPT (e.g. 8x2048)")
        out.append((int(b), int(p)))
    return tuple(out)


def lengths(text: str) -> tuple[int, ...]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not all(x.isdigit() for x in items):
        raise ValueError(f"--lengths: {text!r} is not a comma-separated list of token counts")
    return tuple(int(x) for x in items)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    from pathlib import Path

    import torch

    from pruner.evaluation import timing
    from pruner.runs import folders

    cfg = timing.BenchConfig(lengths=lengths(args.lengths), decode=cases(args.decode), new_tokens=args.new_tokens,
                            repeats=args.repeats)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise PermissionError(f"cannot write {out}/bench.json: permission denied")
    if args.runtime == "onnxruntime-genai":
        result = folders.bench_run_onnx(args.run_dir, cfg)
    elif args.runtime == "llama.cpp":
        result = folders.bench_run_llamacpp(args.run_dir, cfg, args.dtype)
    else:
        result = folders.bench_run(args.run_dir, cfg, args.dtype)
    stem = "bench" if args.runtime == "pytorch" else f"bench-{args.runtime}"
    for name, text in ((f"{stem}.json", json.dumps(result.to_dict(), indent=1) + "\n"),
                       (f"{stem}.md", f"# What the compact model buys\n\n{result.markdown()}\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)  # never half-written
    print("\n" + result.markdown())
    print(f"\nwrote {out}/{stem}.json and {out}/{stem}.md")
    return 0
