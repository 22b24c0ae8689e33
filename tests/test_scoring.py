"""Scorers, selection and plans: registry errors, determinism, constraints, the gradient check."""

from __future__ import annotations

import pytest
import torch
from tiny import ragged_batch, tiny_model

from pruner.attention.sinks import SinkSpec
from pruner.core import arch
from pruner.core.data import pad
from pruner.pruning import scoring
from pruner.pruning.ablation import AblationRequest
from pruner.pruning.calibrate import CalibrationOptions, calibrate, gradient_importance, lm_loss
from pruner.pruning.compensation import compensate
from pruner.pruning.selection import SelectionConfig, SelectionError, convention_sensitivity, select

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llama_inputs():
    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=7, n=6, min_len=8), 0)
    measured = AblationRequest("mean", 4, 0.5, ("ablation", "ablation-shortlist"))
    return model, batch, calibrate(model, batch, SinkSpec("first"),
                                   options=CalibrationOptions(gradient=True, ablation=measured))


def test_unknown_scorer_lists_valid_and_suggests():
    with pytest.raises(ValueError, match=r"did you mean 'sink-aware'\?.*valid: sink-aware, refit-energy, cosine"):
        scoring.get_scorer("sink-awre")


@pytest.mark.parametrize("name", list(scoring.SCORERS))
def test_every_scorer_selects_deterministically(llama_inputs, name):
    model, _, inputs = llama_inputs
    geom = arch.geometry(model)
    cfg = SelectionConfig(target=0.5, min_heads_per_layer=1)
    a = select(scoring.get_scorer(name), inputs, geom, cfg)
    b = select(scoring.get_scorer(name), inputs, geom, cfg)
    assert a.to_json() == b.to_json()
    assert len(a.entries) == 4
    # GQA "equal": every layer keeps the same number of query heads in each KV group
    for layer, hs in a.heads.items():
        left = [h for h in range(4) if h not in hs]
        assert len({sum(1 for h in left if h // 2 == k) for k in range(2)} - {0}) == 1


def test_whole_group_mode_and_layer_budget(llama_inputs):
    model, _, inputs = llama_inputs
    geom = arch.geometry(model)
    plan = select(scoring.get_scorer("fluctuation"), inputs, geom, SelectionConfig(target=2, gqa="group"))
    for layer, hs in plan.heads.items():
        assert hs in ([0, 1], [2, 3])
    per_layer = select(scoring.get_scorer("magnitude"), inputs, geom,
                       SelectionConfig(target=0.5, budget="layer"))
    assert {len(v) for v in per_layer.heads.values()} == {2}


def test_selection_errors(llama_inputs):
    model, _, inputs = llama_inputs
    geom = arch.geometry(model)
    s = scoring.get_scorer("random")
    with pytest.raises(SelectionError, match="selects 0 of"):
        select(s, inputs, geom, SelectionConfig(target=0.01))
    with pytest.raises(SelectionError, match="leaves at most 6 prunable"):
        select(s, inputs, geom, SelectionConfig(target=7, min_heads_per_layer=1))
    with pytest.raises(SelectionError, match="keeps all 4 heads of every layer"):
        select(s, inputs, geom, SelectionConfig(target=1, min_heads_per_layer=4))


def test_twin_aware_redundancy_never_removes_both_twins():
    """Two identical heads: the redundancy scorer removes one and then keeps its twin."""
    model = tiny_model("gpt2")
    with torch.no_grad():  # make head 1 an exact copy of head 0 in layer 0 (q, k, v columns)
        w = model.transformer.h[0].attn.c_attn.weight  # (d, 3 * d), Conv1D
        for part in range(3):
            base = part * 32
            w[:, base + 8: base + 16] = w[:, base: base + 8]
    batch = pad(ragged_batch(seed=8, n=4, min_len=8), 0)
    inputs = calibrate(model, batch, SinkSpec("first"))
    sim = inputs.stats.pairs["cosine/full"][0]
    assert sim[0, 1] == pytest.approx(1.0, abs=1e-6)
    plan = select(scoring.get_scorer("cosine"), inputs, arch.geometry(model), SelectionConfig(target=2))
    first = plan.entries[0]
    assert (first.layer, first.head) in ((0, 0), (0, 1)) and first.twin in (0, 1)
    assert not {(0, 0), (0, 1)} <= {(e.layer, e.head) for e in plan.entries}


def test_convention_sensitivity_reports_changes(llama_inputs):
    model, _, inputs = llama_inputs
    geom = arch.geometry(model)
    cfg = SelectionConfig(target=0.5)
    plan = select(scoring.get_scorer("cosine"), inputs, geom, cfg)
    sens = convention_sensitivity(scoring.get_scorer("cosine"), inputs, geom, cfg, plan)
    assert sens.convention == "full" and sens.other == "content"
    assert sens.changed == len(sens.only_this) == len(sens.only_other)
    assert convention_sensitivity(scoring.get_scorer("magnitude"), inputs, geom, cfg,
                                  select(scoring.get_scorer("magnitude"), inputs, geom, cfg)) is None


def test_gradient_matches_finite_differences():
    """|dL/d mask_h| from autograd equals a central finite difference, per example."""
    model = tiny_model("gpt2").double()
    batch = pad(ragged_batch(seed=9, n=1, min_len=12, max_len=12), 0)
    raw = torch.zeros(2, 4, dtype=torch.float64)
    ad, g = arch.adapter_for(model), arch.geometry(model)
    eps = 1e-5
    for layer in range(2):
        for h in range(4):
            vals = []
            for sign in (1, -1):
                scale = torch.ones(g.n_heads * g.head_dim, dtype=torch.float64)
                scale[h * g.head_dim:(h + 1) * g.head_dim] += sign * eps
                o = arch.get(arch.blocks(model)[layer], ad.o_proj)
                hook = o.register_forward_pre_hook(lambda m, args, s=scale: (args[0] * s,))
                with torch.no_grad():
                    vals.append(lm_loss(model, batch.input_ids, batch.attention_mask).item())
                hook.remove()
            raw[layer, h] = abs(vals[0] - vals[1]) / (2 * eps)
    got = gradient_importance(model, batch)
    torch.testing.assert_close(got, raw / raw.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-7)


def test_gradient_importance_computes_no_weight_gradients_and_restores_the_flags():
    """Only the head mask needs a gradient: weights are frozen during the passes (no model-sized .grad)."""
    model = tiny_model("llama")
    model.model.embed_tokens.weight.requires_grad_(False)  # a flag the caller chose stays as it was
    seen = []
    hook = arch.get(arch.blocks(model)[0], arch.adapter_for(model).o_proj).register_forward_hook(
        lambda m, args, out: seen.append(m.weight.requires_grad))
    gradient_importance(model, pad(ragged_batch(seed=2, n=2), 0))
    hook.remove()
    assert seen and not any(seen)
    assert all(p.grad is None for p in model.parameters())
    assert not model.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "model.embed_tokens.weight")


def test_bos_sink_is_the_eager_attention_on_the_first_token():
    """Sok et al.'s score: the mean attention each head gives position 0, from eager maps; highest pruned first."""
    from pruner.attention.eager import eager_sink_mass

    model, batch, inputs = llama_inputs_fresh()
    scores = scoring.get_scorer("bos-sink")(inputs, torch.ones(2, 4, dtype=torch.bool))
    torch.testing.assert_close(-scores, eager_sink_mass(model, batch), rtol=0, atol=1e-5)
    gpt2 = tiny_model("gpt2")
    inputs = calibrate(gpt2, batch, SinkSpec("first"))
    plan = select(scoring.get_scorer("bos-sink"), inputs, arch.geometry(gpt2), SelectionConfig(target=3))
    order = inputs.stats.sink_mass.flatten().argsort(descending=True)[:3].tolist()
    assert [e.layer * 4 + e.head for e in plan.entries] == order  # the most sink-bound heads, in order


def llama_inputs_fresh():
    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=7, n=6, min_len=8), 0)
    return model, batch, calibrate(model, batch, SinkSpec("first"))


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_output_norm_is_the_mean_squared_norm_after_w_o(family):
    """Sandoval-Segura et al.'s score: E||W_O,h o_h||^2 over real tokens, from the output projection's input."""
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=7, n=6, min_len=8), 0)
    inputs = calibrate(model, batch, SinkSpec("first"))
    ad, g = arch.adapter_for(model), arch.geometry(model)
    seen = {}
    hooks = [arch.get(b, ad.o_proj).register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].detach()))
             for i, b in enumerate(arch.blocks(model))]
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
              position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp_min(0))
    for h in hooks:
        h.remove()
    real = batch.attention_mask.bool()
    want = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64)
    for layer in range(g.n_layers):
        w = arch.o_weight_cols(model, layer).double()  # (d_model, H * d)
        x = seen[layer].double()[real]  # (tokens, H * d)
        for h in range(g.n_heads):
            cols = slice(h * g.head_dim, (h + 1) * g.head_dim)
            want[layer, h] = (x[:, cols] @ w[:, cols].t()).square().sum(-1).mean()
    got = scoring.get_scorer("output-norm")(inputs, torch.ones(g.n_layers, g.n_heads, dtype=torch.bool))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("compensation", ["zero", "mean", "refit"])
def test_ablation_equals_removing_each_head_and_measuring(compensation):
    """The `ablation` scorer is literally: remove the head (physically, with the compensation), measure the
    calibration loss on the subset, subtract the unpruned loss."""
    import copy

    from pruner.core.data import TokenBatch
    from pruner.pruning import surgery
    from pruner.pruning.ablation import token_nll

    model = tiny_model("gpt2")
    batch = pad(ragged_batch(seed=3, n=24, min_len=20, max_len=30), 0)
    inputs = calibrate(model, batch, SinkSpec("first"),
                       options=CalibrationOptions(ablation=(compensation, 5), ridge=1e-3))
    sub = TokenBatch(batch.input_ids[:5], batch.attention_mask[:5])
    s0, c0 = token_nll(model, sub)
    g = arch.geometry(model)
    for layer in range(g.n_layers):
        for h in range(g.n_heads):
            pruned = copy.deepcopy(model)
            comp = compensate(model, {layer: [h]}, inputs.stats.outputs, compensation, 1e-3)
            surgery.remove_heads(pruned, {layer: [h]}, comp)
            s, c = token_nll(pruned, sub)
            assert inputs.ablation[layer, h].item() == pytest.approx(s / c - s0 / c0, abs=1e-6)
    assert inputs.costs["ablation"]["passes"] == g.n_layers * g.n_heads + 1
    assert inputs.costs["ablation"]["windows"] == 5


def test_refit_costs_reuse_the_layers_a_greedy_step_did_not_change(llama_inputs):
    """A greedy step removes one head: the other layers' marginal costs are taken from the last step, and equal
    a fresh computation on inputs with nothing cached, step after step."""
    import dataclasses

    inputs = llama_inputs[2]
    g = inputs.gram.shape[:2]
    alive = torch.ones(g, dtype=torch.bool)
    for layer, head in [(0, 1), (1, 2), (0, 3), (1, 0)]:
        alive[layer, head] = False
        cached = scoring.refit_costs(inputs, alive)
        fresh = scoring.refit_costs(dataclasses.replace(inputs, _systems=[], _costs={}), alive)
        torch.testing.assert_close(cached, fresh, rtol=1e-9, atol=1e-12 * float(fresh.abs().max()))
        assert not cached[layer, head]
    assert sum(isinstance(k, int) for k in inputs._costs) == g[0]


def test_the_pruned_sets_inverse_is_bordered_not_inverted_afresh(monkeypatch):
    """Growing P block by block: the carried inverse equals a fresh inverse of Q_PP (in its own channel order)
    and the marginal costs equal those computed without a carried state; torch.linalg.inv runs only on the
    k x k Schur complements."""
    from pruner.pruning import refit

    D, d = 24, 4
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(D, D, dtype=torch.float64, generator=gen)
    w = torch.randn(D, D, generator=gen)
    system = refit.system(w.t() @ w, None, a @ a.t() / D, 0.1)
    state, pruned = {}, torch.zeros(D, dtype=torch.bool)
    for head in (2, 0, 5):
        pruned[head * d:(head + 1) * d] = True
        blocks = [torch.arange(h * d, (h + 1) * d) for h in range(D // d) if not pruned[h * d]]
        carried = refit.marginal_costs(system, pruned, blocks, state)
        assert carried == pytest.approx(refit.marginal_costs(system, pruned, blocks), rel=1e-9, abs=1e-12)
        order = state["order"]
        torch.testing.assert_close(state["inverse"], torch.linalg.inv(system.precision[order][:, order]),
                                   rtol=1e-9, atol=1e-9)
    sizes = []
    real = torch.linalg.inv
    monkeypatch.setattr(torch.linalg, "inv", lambda m: sizes.append(m.shape[0]) or real(m))
    pruned[4 * d:5 * d] = True
    refit.marginal_costs(system, pruned, [torch.arange(d)], state)
    assert max(sizes) == d  # the new block's Schur complement and the candidate's: no |P| x |P| inverse
