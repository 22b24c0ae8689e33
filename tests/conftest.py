"""Shared fixtures. Test tiers are pytest markers: unit, integration, slow (see pyproject)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.utils import logging as transformers_logging

# Under pytest-xdist (the test command runs one worker per core) each worker computes on one thread:
# two workers x two torch threads on two cores would only fight. Tests that compare thread counts set
# them explicitly; subprocesses (torchrun, the memory probe) set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# transformers attaches its stderr handler on first use. Inside a test that handler would keep that
# test's capture stream, which pytest closes afterwards; every later transformers warning then prints a
# "--- Logging error ---" traceback into whichever test is running (failing its no-traceback checks).
# Attaching it here, at collection, binds it to the session's stream instead.
transformers_logging.get_logger("transformers")


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

    from pruner.core import assets

    return AutoTokenizer.from_pretrained(assets.minilm())


def _llamacpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def pytest_collection_modifyitems(config, items):
    """The llama_cpp tier (generation in llama.cpp) runs wherever llama-cpp-python is installed; elsewhere its
    tests are deselected, not skipped into green, and the summary says so in one line."""
    if _llamacpp_installed():
        return
    tier = [item for item in items if item.get_closest_marker("llama_cpp")]
    if tier:
        items[:] = [item for item in items if not item.get_closest_marker("llama_cpp")]
        config.hook.pytest_deselected(items=tier)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _llamacpp_installed():
        terminalreporter.write_line('llama.cpp tier not run (tests marked llama_cpp): llama-cpp-python is not '
                                    'installed; pip install "pruner[llamacpp]" to run it (builds llama.cpp, ~13 min '
                                    'on 2 cores)')
