"""ONNX Runtime GenAI: a vanilla compact checkpoint converted by its model builder, and proved by its generator.

ONNX Runtime GenAI's builder (`python -m onnxruntime_genai.models.builder`) reads a vanilla
transformers checkpoint -- config.json, safetensors, tokenizer -- and writes `model.onnx`
(+ external weights), `genai_config.json` and the tokenizer files its generator runs with,
KV cache included. It knows the vanilla architectures only, so a per-layer checkpoint (layers
with different head counts) cannot go through it: `selection.shape: servable` prunes so that
one can. Nothing is published that does not run: `check` generates greedily with the GenAI
generator from a fixed prompt and requires the tokens PyTorch generates from the same checkpoint.

One shape needs a hand: a Llama whose pruned head count Llama's config refuses is written as a vanilla
`MistralForCausalLM` with an explicit `head_dim` (`saving`), and the builder's Mistral path does not take
Llama 3's scaled rope (NotImplementedError "The llama3 RoPE style is not currently supported") while its
Llama path does, reading `head_dim` from the config as the Mistral path does. The two are the same
network, so the builder is pointed at its Llama path for that checkpoint (`_builder_input`); the
generation check proves the result.

The builder and the generator are the optional extra `onnx` (`pip install "pruner[onnx]"`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
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
    with tempfile.TemporaryDirectory(prefix="pruner-onnx-input-") as shadow:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(_builder_input(checkpoint,
               Path(shadow))), "-o", str(out), "-p", PRECISIONS[dtype], "-e", "cpu", "-c", str(out / ".cache")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        lines = [x for x in (done.stderr.strip() or done.stdout.strip()).splitlines() if x.strip()]
        raise OnnxError(f"the ONNX Runtime GenAI builder failed on {checkpoint}: "
                        f"{lines[-1] if lines else f'exit status {done.returncode}'}")
    for f in (out / ".cache").glob("**/*"):  # the builder's download cache: empty offline, never published
        if f.is_file():
            f.unlink()
    for d in sorted((out / ".cache").glob("**/*"), reverse=True) + [out / ".cache"]:
        if d.is_dir():
            d.rmdir()


def _builder_input(checkpoint: Path, shadow: Path) -> Path:
    """The folder the builder reads: `checkpoint` itself, or for a Mistral checkpoint with Llama 3's scaled
    rope a `shadow` of it (links to its files) whose config.json names the builder's Llama path."""
    config = json.loads((checkpoint / "config.json").read_text())
    rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type")
    if config.get("architectures") != ["MistralForCausalLM"] or rope != "llama3":
        return checkpoint
    for f in checkpoint.iterdir():
        if f.is_file() and f.name != "config.json":
            (shadow / f.name).symlink_to(f.resolve())
    (shadow / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=2))
    return shadow


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
