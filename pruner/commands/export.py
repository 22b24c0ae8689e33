"""`pruner export RUN_DIR`: a shareable, reload-checked checkpoint of a run, its model card, and the push."""

from __future__ import annotations

import argparse


def add_parser(sub, common) -> None:
    p = sub.add_parser("export", parents=[common],
                       help="a shareable checkpoint of a run (dense or compact) + model card; push",
                       description="Rebuild a run's pruned model from RUN_DIR (recipe.yaml, plan.json, "
                                   "compensation.safetensors), write it as a transformers checkpoint with a model "
                                   "card, check that it reloads (logits and greedy generation), and optionally "
                                   "push it to the Hub.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="output folder of `pruner prune`")
    p.add_argument("--format", required=True, choices=("dense", "compact", "onnx", "gguf"),
                   help="dense: pruned heads zeroed, original shapes, loads anywhere; compact: heads removed, "
                        "smaller -- a vanilla checkpoint where the family's config can describe it, else the "
                        "per-layer form (trust_remote_code=True, or pruner.load); onnx: the vanilla compact "
                        "model through ONNX Runtime GenAI's builder for the CPU, its generations checked "
                        "(needs the onnx extra); gguf: one GGUF file for llama.cpp (Llama and Mistral, whose layers may "
                        "keep different head counts; Gemma 3 with the same heads in every layer), its generations "
                        "checked in llama.cpp where llama-cpp-python is installed (the gguf extra; llamacpp for "
                        "the check and --quantize)")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"),
                   help="storage dtype (default: the recipe's export.dtype; auto = the base checkpoint's own); "
                        "onnx: the ONNX precision (default float32); gguf: the matrices' type (norms stay float32)")
    p.add_argument("--quantize", metavar="TYPE",
                   help="gguf: also model-TYPE.gguf, model.gguf quantized by llama.cpp's own quantizer (the llamacpp "
                        "extra), and both files' perplexity on the run's evaluation text in llama.cpp; TYPE: "
                        "q8_0, q6_k, q5_k_m, q5_k_s, q5_1, q5_0, q4_k_m, q4_k_s, q4_1, q4_0, q3_k_l, q3_k_m, "
                        "q3_k_s, q2_k")
    p.add_argument("--out", help="export folder (default: RUN_DIR/export-FORMAT)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this Hub model repo (created if needed)")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    p.add_argument("--allow-changed-base", action="store_true",
                   help="export even if the base model is not the one the run was made from (provenance.json); "
                        "the model card says so")
    p.set_defaults(func=run)


def print_export(done, url) -> None:
    if done.format == "gguf":
        arch = done.layout.removeprefix("gguf-")
        print(f"exported a GGUF for llama.cpp (architecture {arch}, {done.dtype}): {done.params:,} parameters, "
              f"{done.bytes / 1e6:.1f} MB; " + ("llama.cpp's greedy generations equal PyTorch's (float32)"
                                                if done.generation else _skipped()))
        if done.note:
            print(f"tokenizer: {done.note}")
        q = done.quantized
        if q:
            print(f"quantized by llama.cpp to {q.name}: {q.file} {q.bytes / 1e6:.1f} MB (model.gguf "
                  f"{done.bytes / 1e6:.1f} MB)" + (
                      f"; perplexity in llama.cpp on {q.windows} evaluation windows: {q.perplexity:.3f} "
                      f"({done.dtype}: {q.float_perplexity:.3f}), the same top-1 token at {q.top1_agreement:.1%} "
                      "of positions" if q.windows else ""))
        files = f"model.gguf, {q.file}" if q else "model.gguf"
        print(f"wrote {done.folder}/ ({files}, README.md model card, plan.json)")
        if url:
            print(f"pushed to {url}")
        return
    if done.format == "onnx":
        print(f"exported an ONNX Runtime GenAI model ({done.dtype}, CPU): {done.params:,} parameters, "
              f"{done.bytes / 1e6:.1f} MB; its greedy generations equal PyTorch's")
        print(f"wrote {done.folder}/ (model.onnx, genai_config.json, tokenizer, README.md model card, plan.json)")
        if url:
            print(f"pushed to {url}")
        return
    form = f"{done.layout}, " if done.format == "compact" else ""
    how = ("reloads with trust_remote_code=True and with pruner.load" if done.layout == "per-layer"
           else "reloads with plain transformers")
    print(f"exported a {done.format} checkpoint ({form}{done.dtype}): {done.params:,} parameters, "
          f"{done.bytes / 1e6:.1f} MB of weights; {how} (max |logit difference| {done.max_diff:.1e}"
          + (", the same greedy tokens)" if done.generation else ")"))
    if done.why_per_layer:
        print(f"per-layer because {done.why_per_layer}")
    if getattr(done, "note", None):
        print(f"vanilla, {done.note}")
    print(f"wrote {done.folder}/ (checkpoint, README.md model card, plan.json)")
    if url:
        print(f"pushed to {url}")


def _skipped() -> str:
    from pruner.checkpoints import llamacpp

    return llamacpp.skipped_note() + "; its structure was checked with the gguf reader"


def run(args: argparse.Namespace) -> int:
    from pruner import api

    if args.private and not args.push_to_hub:
        raise ValueError("--private applies only with --push-to-hub REPO_ID")
    print_export(*api.export_run(args.run_dir, args.format, args.out, overwrite=args.overwrite,
                                 push_to_hub=args.push_to_hub, private=args.private, dtype=args.dtype,
                                 allow_changed_base=args.allow_changed_base, quantize=args.quantize))
    return 0
