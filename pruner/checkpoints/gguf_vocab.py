"""The tokenizer in a GGUF (`pruner.checkpoints.gguf_file` writes the rest): llama.cpp's names for it and its
token list, from the tokenizer's tokenizer.json.

The byte-level BPE tokenizer (Llama, Mistral) goes in with its special tokens; llama.cpp knows pre-tokenizers by
name, so a GPT-2-style one is written as `gpt-2` and any other as `default` (token ids are unaffected; text may
split differently: `gguf_file.tokenizer_note` says so). Gemma's tokenizer (SentencePiece-style BPE with byte
fallback in tokenizer.json) goes in as llama.cpp's `llama` tokenizer: tokens, scores (the rank of the merge
that makes each token, negated: llama.cpp's SentencePiece tokenizer merges the highest-scoring pair first, as
transformers applies the lowest-ranked merge), types (byte, control, user-defined), no space prefix.
"""

from __future__ import annotations

import json

from pruner.checkpoints.storage import CheckpointError

_GPT2_STYLE = {"type": "ByteLevel", "use_regex": True}


class GgufError(CheckpointError):
    """A model llama.cpp cannot run in this form, or a GGUF that does not reproduce it; one line, what would work."""


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE: `gpt-2` for GPT-2's byte-level regex,
    else `default` (llama.cpp knows pre-tokenizers by the hash of known models' outputs, not by their rules)."""
    spec = _tokenizer_json(tokenizer)
    kind, fallback = spec["model"].get("type"), spec["model"].get("byte_fallback")
    if kind != "BPE" or fallback:
        raise GgufError("cannot write a GGUF: pruner carries byte-level BPE tokenizers into GGUF, and this one is "
                        f"{kind}{' with byte fallback' if fallback else ''}: export --format compact")
    pre = spec.get("pre_tokenizer") or {}
    return "gpt-2" if all(pre.get(k) == v for k, v in _GPT2_STYLE.items()) else "default"


def spm_check(tokenizer) -> str:
    """`default` for a SentencePiece-style tokenizer.json (BPE over `▁`-joined text, byte fallback: Gemma's),
    which goes in as llama.cpp's `llama` tokenizer; GgufError for any other."""
    spec = _tokenizer_json(tokenizer)
    kind, fallback = spec["model"].get("type"), spec["model"].get("byte_fallback")
    if kind != "BPE" or not fallback:
        raise GgufError("cannot write a GGUF: pruner carries Gemma's SentencePiece-style BPE tokenizer (byte "
                        f"fallback) into GGUF, and this one is {kind}{'' if fallback else ' without byte fallback'}: "
                        "export --format compact")
    return "default"


def _tokenizer_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise GgufError("cannot write a GGUF: the tokenizer has no tokenizer.json (a fast tokenizer) to carry")
    return json.loads(backend.to_str())


def vocab(w, tokenizer, vocab_size: int, pre: str) -> None:
    """Tokens (padded to the model's vocabulary with unused `[PAD<i>]`), types, merges and special tokens."""
    import gguf

    spec = _tokenizer_json(tokenizer)
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    if max(ids.values()) >= vocab_size:
        raise GgufError(f"cannot write a GGUF: the tokenizer has ids up to {max(ids.values())} and the model "
                        f"{vocab_size} embeddings")
    by_id = {i: tok for tok, i in ids.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(gguf.TokenType.NORMAL if i not in added else
                     gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    _special_tokens(w, tokenizer)


def spm_vocab(w, tokenizer, vocab_size: int) -> None:
    """A SentencePiece-style BPE tokenizer as llama.cpp's `llama` tokenizer: tokens by id (padded to the model's
    vocabulary with unused `[PAD<i>]`), scores from the merge ranks, types, special tokens, no space prefix."""
    import gguf

    spec = _tokenizer_json(tokenizer)
    vocab = spec["model"]["vocab"]
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id = {i: tok for tok, i in vocab.items()} | {i: t["content"] for i, t in added.items()}
    if max(by_id) >= vocab_size:
        raise GgufError(f"cannot write a GGUF: the tokenizer has ids up to {max(by_id)} and the model "
                        f"{vocab_size} embeddings")
    rank = {}
    for r, m in enumerate(spec["model"].get("merges", [])):
        rank.setdefault("".join(m.split(" ", 1)) if isinstance(m, str) else "".join(m), r)
    unk = getattr(tokenizer, "unk_token_id", None)
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        tokens.append(f"[PAD{i}]" if tok is None else tok)
        scores.append(-float(rank[tok]) if tok in rank else 0.0)
        types.append(gguf.TokenType.UNUSED if tok is None else
                     gguf.TokenType.UNKNOWN if i == unk else
                     (gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
                     if i in added else
                     gguf.TokenType.BYTE if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") else
                     gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    _special_tokens(w, tokenizer)
    w.add_add_space_prefix(False)


def _special_tokens(w, tokenizer) -> None:
    """bos/eos/pad/unk ids, whether text starts with bos (ends with eos), the chat template."""
    for name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                      ("unk", w.add_unk_token_id)):
        tid = getattr(tokenizer, f"{name}_token_id", None)
        if tid is not None:
            add(int(tid))
    probe = tokenizer("a")["input_ids"]
    w.add_add_bos_token(bool(probe) and probe[0] == tokenizer.bos_token_id)
    w.add_add_eos_token(bool(probe) and probe[-1] == tokenizer.eos_token_id and len(probe) > 1)
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        w.add_chat_template(tokenizer.chat_template)
