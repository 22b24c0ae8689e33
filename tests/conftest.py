"""Shared fixtures. Test tiers are pytest markers: unit, integration, slow (see pyproject)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def word_tokenizer():
    """A tiny word-level tokenizer with BOS/EOS/PAD, built in memory (no files, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "<bos> <eos> <pad> <unk> the king queen a of and to is was my lord good".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="session")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    from pruner import assets

    return AutoTokenizer.from_pretrained(assets.minilm())
