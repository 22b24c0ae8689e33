"""llama.cpp itself runs a written GGUF: greedy tokens from a fixed prompt against PyTorch's on the same model.

A structure check (`gguf_file.check_structure`) proves the file holds the tensors pruner meant; only
llama.cpp proves it *runs* them as transformers does -- the per-head q/k permutation for its rope, the
deci architecture's per-layer head counts, the rope scaling. So before an export is renamed into place the
GGUF is loaded through `llama-cpp-python` (the optional extra `llamacpp`; pip builds llama.cpp from source
where no wheel fits) and must generate, greedily and through its KV cache, the tokens the pruned model
generates in PyTorch (float32: both sides compute the same function, with no rounding between them to
hide a wrong tensor behind). Where the extra is not installed, the export says that the check was skipped
and how to get it; the structure check still runs.

Greedy here is argmax of the last position's logits, token by token, in both runtimes: no sampler, no
end-of-sequence handling, so a model that would emit its EOS is compared on it like any other token.

`quantize` turns a written float GGUF into a quantized one with llama.cpp's own quantizer (what
llama.cpp's `llama-quantize` runs: its k-quant mixes choose per tensor, so q4_k_m keeps some tensors at
higher precision), and `window_scores` scores a file on perplexity windows in llama.cpp, so a quantized
file is reported next to the float one it came from on the same text.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

INSTALL = ('pip install "pruner[llamacpp]"  (llama-cpp-python; pip builds llama.cpp from source where no wheel '
           'fits: about 13 minutes on 2 cores)')
PROMPT_TOKENS = 8
NEW_TOKENS = 16
# llama.cpp's quantization types by `llama-quantize`'s names (llama_cpp.LLAMA_FTYPE_MOSTLY_<NAME>)
QUANT_TYPES = ("q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0", "q3_k_l",
               "q3_k_m", "q3_k_s", "q2_k")


class LlamaCppError(ValueError):
    """A GGUF llama.cpp does not run as PyTorch runs the model; nothing was published."""


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def skipped_note() -> str:
    return f"llama.cpp generation check skipped: llama-cpp-python is not installed ({INSTALL})"


def prompt(vocab_size: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    """The fixed check prompt: `tokens` seeded ids in [3, vocab)."""
    return torch.randint(3, vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def quant_refusal(qtype: str) -> str | None:
    """Why `qtype` cannot be quantized to here (unknown, or llama-cpp-python missing); None if it can."""
    if qtype not in QUANT_TYPES:
        return f"unknown GGUF quantization {qtype!r}; known: {', '.join(QUANT_TYPES)}"
    if not available():
        return f"--quantize needs llama.cpp's quantizer from llama-cpp-python, which is not installed: {INSTALL}"
    return None


def quantize(src: Path, dst: Path, qtype: str, threads: int | None = None) -> None:
    """Quantize the GGUF `src` to `qtype` at `dst` with llama.cpp's own quantizer (its default parameters)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params.nthread = threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise LlamaCppError(f"llama.cpp could not quantize {src.name} to {qtype}; nothing was published")


def open_model(path: Path, n_ctx: int, threads: int | None = None, n_batch: int = 512, logits_all: bool = False):
    """llama.cpp's model and context for a GGUF file (quiet; `threads`: default every core; `logits_all`: keep
    every position's logits, for perplexity)."""
    from llama_cpp import Llama

    threads = threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count()
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                 n_threads_batch=threads, logits_all=logits_all, verbose=False)


def window_scores(path: Path, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, torch.Tensor]:
    """(summed next-token NLL, scored tokens, each scored position's argmax token) of a GGUF in llama.cpp on
    perplexity windows, each from an empty cache. input_ids, labels: (window, q_pos), labels -100 unscored
    and on padding; the label at q_pos is the token there, predicted from q_pos - 1."""
    import numpy as np

    nll, count, top = 0.0, 0, []
    llm = open_model(path, n_ctx=input_ids.shape[1] + 8, n_batch=input_ids.shape[1], logits_all=True)
    try:
        for ids, lab in zip(input_ids.tolist(), labels):
            if not (lab != -100).any():
                continue
            n = int((lab != -100).nonzero().max()) + 1  # the window without its padding: it ends on a scored token
            llm.reset()
            llm.eval(ids[:n])
            logits = torch.from_numpy(np.array(llm.scores[: n - 1], dtype=np.float32))  # (n - 1, vocab)
            target = lab[1:n]
            scored = target != -100
            logp = torch.log_softmax(logits[scored], dim=-1)  # (scored, vocab)
            nll -= float(logp.gather(1, target[scored][:, None]).sum())
            count += int(scored.sum())
            top.append(logits[scored].argmax(-1))
    finally:
        llm.close()
    return nll, count, torch.cat(top) if top else torch.empty(0, dtype=torch.long)


def last_logits(llm) -> torch.Tensor:
    """The logits of the last evaluated position. (vocab,)"""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy())


def llamacpp_greedy(path: Path, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens (prompt included) from llama.cpp with its KV cache: the prompt in one pass, then a token
    at a time."""
    llm = open_model(path, n_ctx=len(ids) + new_tokens + 8)
    try:
        out = list(ids)
        llm.eval(out)
        for _ in range(new_tokens):
            out.append(int(last_logits(llm).argmax()))
            llm.eval(out[-1:])
        return out
    finally:
        llm.close()


def torch_greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens (prompt included) from the PyTorch model with its KV cache, argmax at every step."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    out, cache = list(ids), None
    with torch.no_grad():
        for _ in range(new_tokens):
            step = model(input_ids=x, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]], device=device)
    return out


def check(path: Path, model) -> list[int]:
    """Refuse a GGUF whose llama.cpp greedy tokens differ from `model`'s (the pruned model in PyTorch, float32,
    the same weights as the file); returns the tokens."""
    ids = prompt(model.config.vocab_size)
    want = torch_greedy(model, ids)
    got = llamacpp_greedy(path, ids)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) - len(ids)
        raise LlamaCppError(f"llama.cpp generates differently from PyTorch from the GGUF (greedy, token {first + 1} "
                            f"of {NEW_TOKENS} differs); nothing was published")
    return got
