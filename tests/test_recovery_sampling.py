"""The teacher's own text (`recovery.data: generated`): the two-level inverse-CDF draw is the softmax's
distribution, and a window's text depends on the seed and its index, not on the generation batch."""

from __future__ import annotations

import pytest
import torch

from pruner.recovery import data as rdata
from tests.tiny import tiny_model


def reference(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """One inverse CDF over the whole vocabulary in float64."""
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0].clamp_max(logits.shape[1] - 1)


@pytest.mark.unit
@pytest.mark.parametrize("vocab", [5, 256, 700])  # inside one block, exactly one, two and a short last one
def test_the_draw_is_the_inverse_cdf_of_the_softmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn(400, vocab, generator=g)
    u = torch.rand(400, generator=g, dtype=torch.float64)
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    clear = ((cdf - u[:, None]).abs() > 1e-5).all(1)  # rows whose u is not within float32 rounding of a boundary
    assert clear.sum() > 350
    got = rdata.draw(logits, u)
    assert torch.equal(got[clear], reference(logits, u)[clear])
    assert torch.equal(rdata.draw(logits, u, temperature=2.5), rdata.draw(logits / 2.5, u))


@pytest.mark.unit
def test_a_grid_of_uniforms_draws_each_token_as_often_as_its_probability_and_never_an_impossible_one():
    g = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(600, generator=g)
    logits[[0, 255, 256, 599, 300]] = float("-inf")  # block edges, the last token, one inside
    n = 200_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # every quantile once
    counts = torch.zeros(600)
    for part in u.split(20_000):
        counts += torch.bincount(rdata.draw(logits.expand(len(part), -1), part), minlength=600)
    p = torch.softmax(logits.double(), -1)
    assert counts[[0, 255, 256, 599, 300]].sum() == 0
    assert (counts / n - p).abs().max() <= 2 / n  # a grid point either side of each boundary at most


@pytest.mark.unit
def test_a_windows_text_depends_on_the_seed_and_its_index_not_on_the_batch():
    teacher = tiny_model("llama").eval()
    whole = rdata.sample(teacher, 1, 6, 12, seed=3)
    assert whole.shape == (6, 12) and (whole[:, 0] == 1).all()
    assert torch.equal(rdata.sample(teacher, 1, 6, 12, seed=3, batch_size=2), whole)
    assert torch.equal(rdata.sample(teacher, 1, 4, 12, seed=3), whole[:4])  # fewer windows: the same first ones
    assert not torch.equal(rdata.sample(teacher, 1, 6, 12, seed=4), whole)
    u = torch.rand(6, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():  # each token: the draw from the whole prefix's logits, no KV cache
        for t in range(11):
            assert torch.equal(whole[:, t + 1], rdata.draw(teacher(input_ids=whole[:, :t + 1]).logits[:, -1], u[:, t]))


@pytest.mark.unit
def test_the_generation_batch_keeps_its_cache_and_logits_within_the_budget(monkeypatch):
    teacher = tiny_model("llama")  # 2 layers x 2 KV heads x 8 dims, float32, 64 tokens
    per_window = 2 * 2 * 2 * 8 * 4 * 16 + 12 * 64
    want = min(rdata.MAX_GENERATE_BATCH, rdata.GENERATE_BYTES // per_window)
    assert rdata.generation_batch(teacher, 16, 1000) == want
    monkeypatch.setattr(rdata, "GENERATE_BYTES", 5 * per_window + 1)
    assert rdata.generation_batch(teacher, 16, 1000) == 5
    assert rdata.generation_batch(teacher, 16, 3) == 3
    monkeypatch.setattr(rdata, "GENERATE_BYTES", 1)
    assert rdata.generation_batch(teacher, 16, 1000) == 1
