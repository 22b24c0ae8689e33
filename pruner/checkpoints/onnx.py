"""ONNX Runtime GenAI: a vanilla compact checkpoint converted by its model builder, and proved by its generator.

ONNX Runtime GenAI's builder (`python -m onnxruntime_genai.models.builder`) reads a vanilla
transformers checkpoint -- config.json, safetensors, tokenizer -- and writes `model.onnx`
(+ external weights), `genai_config.json` and the tokenizer files its generator runs with,
KV cache included. It knows the vanilla architectures only, so a per-layer checkpoint (layers
with different head counts) cannot go through it: `selection.shape: servable` prunes so that
one can. Nothing is published that does not run: `check` generates greedily with the GenAI
generator from a fixed prompt and requires the tokens PyTorch generates from the same checkpoint.

The builder and the generator are the optional extra `onnx` (`pip install "pruner[onnx]"`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from pruner.checkpoints import saving

INSTALL = 'pip install "pruner[onnx]"  (onnxruntime-genai, onnx-ir, onnxscript)'
PRECISIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
PROMPT_TOKENS = 8
NEW_TOKENS = 16


class OnnxError(ValueError):
    """An ONNX export that cannot be made or does not reproduce the model; the message says what to do."""


def require() -> None:
    """The `onnx` extra, or one line saying how to install it."""
    try:
        import onnxruntime_genai  # noqa: F401
        from onnxruntime_genai.models import builder  # noqa: F401
    except ImportError:
        raise OnnxError(f"ONNX export needs ONNX Runtime GenAI and its model builder, which are not installed: "
                        f"{INSTALL}") from None


def build(checkpoint: Path, out: Path, dtype: str = "float32") -> None:
    """Run the GenAI model builder on a vanilla checkpoint folder, for the CPU, in `dtype`."""
    require()
    if dtype not in PRECISIONS:
        raise OnnxError(f"ONNX export dtype {dtype!r} is not one of {', '.join(PRECISIONS)}")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
           "-p", PRECISIONS[dtype], "-e", "cpu", "-c", str(out / ".cache")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        lines = [x for x in (done.stderr + done.stdout).strip().splitlines() if x.strip()]
        raise OnnxError(f"the ONNX Runtime GenAI builder failed on {checkpoint}: "
                        f"{lines[-1] if lines else f'exit status {done.returncode}'}")
    for f in (out / ".cache").glob("**/*"):  # the builder's download cache: empty offline, never published
        if f.is_file():
            f.unlink()
    for d in sorted((out / ".cache").glob("**/*"), reverse=True) + [out / ".cache"]:
        if d.is_dir():
            d.rmdir()


def prompt(vocab_size: int, tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """The fixed check prompt: (1, tokens) ids, seeded."""
    return torch.randint(3, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))


def genai_greedy(folder: Path, ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens (prompt included) from the GenAI generator with its KV cache."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    length = ids.shape[1] + new_tokens
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids.numpy().astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


def torch_greedy(model, ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens (prompt included) from transformers' `generate` with its KV cache."""
    return saving.greedy(model, ids, new_tokens)[0].tolist()


def check(folder: Path, reference) -> list[int]:
    """Refuse an export whose GenAI greedy tokens differ from `reference`'s (the transformers model of the
    same checkpoint, in the export's precision); returns the tokens."""
    ids = prompt(reference.config.vocab_size)
    want = torch_greedy(reference, ids)
    got = genai_greedy(folder, ids)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) - ids.shape[1]
        raise OnnxError(f"the ONNX model generates differently from PyTorch (greedy, token {first + 1} of "
                        f"{NEW_TOKENS} differs); nothing was published")
    return got
