"""Sink specifications: every mode, padding-invariant positions, clear errors."""

from __future__ import annotations

import pytest
import torch

from pruner.attention.sinks import SinkSpec, relative_positions, sink_mask

pytestmark = pytest.mark.unit

IDS = torch.tensor([[0, 0, 101, 7, 8, 102], [101, 9, 102, 5, 6, 102]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def test_first_is_first_real_token_under_left_padding():
    m = sink_mask(IDS, MASK, SinkSpec("first"))
    assert m.tolist() == [[False, False, True, False, False, False], [True] + [False] * 5]
    assert relative_positions(MASK)[0].tolist() == [-1, -1, 0, 1, 2, 3]


def test_special_bos_ids_positions(minilm_tokenizer):
    special = sink_mask(IDS, MASK, SinkSpec("special"), minilm_tokenizer)
    assert special.tolist() == [[False, False, True, False, False, True], [True, False, True, False, False, True]]
    bos = sink_mask(IDS, MASK, SinkSpec("bos"), minilm_tokenizer)  # BERT: [CLS]
    assert bos.sum().item() == 2 and bos[0, 2] and bos[1, 0]
    ids = sink_mask(IDS, MASK, SinkSpec("ids", ids=(7, 9)))
    assert ids.nonzero().tolist() == [[0, 3], [1, 1]]
    pos = sink_mask(IDS, MASK, SinkSpec("positions", positions=(0, 1)))
    assert pos.nonzero().tolist() == [[0, 2], [0, 3], [1, 0], [1, 1]]


def test_padding_is_never_a_sink():
    m = sink_mask(IDS, MASK, SinkSpec("ids", ids=(0,)))
    assert not m.any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="cls"), "unknown sink mode"),
    (dict(mode="ids"), "at least one token id"),
    (dict(mode="positions"), "at least one position"),
    (dict(mode="positions", positions=(-1,)), ">= 0"),
    (dict(mode="auto", eps=1.5), r"\(0, 1\)"),
])
def test_invalid_specs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SinkSpec(**kwargs)


def test_auto_must_be_resolved_first():
    with pytest.raises(ValueError, match="resolved"):
        sink_mask(IDS, MASK, SinkSpec("auto"))
