"""Refit compensation (docs/design.md §8.1): the closed form, the Schur-complement energy, the invariants.

Unit tier: `pruner.pruning.refit` against an independent least-squares solve on synthetic
float64 samples. Integration tier: tiny models of every family -- no head pruned is
the identity, a pruned head the kept ones can rebuild exactly leaves the model's
outputs unchanged, mask == remove == vanilla reload with the refitted weights.
"""

from __future__ import annotations

import pytest
import torch
from tiny import CAUSAL, ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core import arch
from pruner.core.data import pad
from pruner.core.runtime import forward
from pruner.pruning import refit, surgery
from pruner.pruning.compensation import compensate, refit_layer, refit_sequential
from pruner.runs import export, folders

D_MODEL, H, HD = 6, 4, 3
D = H * HD


def samples(n: int = 400, seed: int = 0) -> torch.Tensor:
    """(n, D) correlated, non-centred synthetic head outputs."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(D, D, generator=g, dtype=torch.float64)
    return torch.randn(n, D, generator=g, dtype=torch.float64) @ mix + torch.randn(D, generator=g, dtype=torch.float64)


def sums(x: torch.Tensor):
    return x.sum(0), x.t() @ x, x.shape[0]


def weight(seed: int = 1) -> torch.Tensor:
    return torch.randn(D_MODEL, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def channels(heads: list[int]) -> torch.Tensor:
    p = torch.zeros(D, dtype=torch.bool)
    for h in heads:
        p[h * HD:(h + 1) * HD] = True
    return p


@pytest.mark.unit
@pytest.mark.parametrize("intercept", [True, False])
@pytest.mark.parametrize("ridge", [0.0, 1e-3, 0.3])
def test_fit_equals_the_closed_form_ridge_regression(intercept, ridge):
    """delta_W, delta_b and E(P) equal an independent augmented least-squares solve (float64, 1e-9)."""
    x, w = samples(), weight()
    p = channels([1, 3])
    mu, s = refit.second_moment(*sums(x), intercept)
    fit = refit.fit_layer(w, mu if intercept else None, s, p, ridge)
    xk, xp = x[:, ~p], x[:, p]
    if intercept:
        xk, xp = xk - xk.mean(0), xp - xp.mean(0)
    n, lam = x.shape[0], fit.lam
    assert lam == pytest.approx(ridge * float(torch.diagonal(s).mean()), rel=1e-12)
    # ridge regression of x_P on x_K as one least-squares problem: [X_K; sqrt(n lam) I] A = [X_P; 0]
    aug_x = torch.cat([xk, (n * lam) ** 0.5 * torch.eye(xk.shape[1], dtype=torch.float64)])
    aug_y = torch.cat([xp, torch.zeros(xk.shape[1], xp.shape[1], dtype=torch.float64)])
    a = torch.linalg.lstsq(aug_x, aug_y).solution  # (|K|, |P|)
    w_p = w[:, p]
    torch.testing.assert_close(fit.delta_w[:, ~p], w_p @ a.t(), rtol=0, atol=1e-9)
    assert torch.equal(fit.delta_w[:, p], torch.zeros_like(fit.delta_w[:, p]))
    if intercept:  # the refitted layer keeps the calibration mean: (W + dW) mu_masked + db = W mu
        w_new = w + fit.delta_w
        w_new[:, p] = 0
        torch.testing.assert_close(w_new @ mu + fit.delta_b, w @ mu, rtol=0, atol=1e-9)
    else:
        assert fit.delta_b is None
    # E(P) is the minimum of the ridge objective E||W_P (x_P - A^T x_K)||^2 + lam ||W_P A^T||^2
    resid = (xp - xk @ a) @ w_p.t()
    objective = resid.pow(2).sum() / n + lam * (w_p @ a.t()).pow(2).sum()
    assert fit.unexplained == pytest.approx(float(objective), rel=1e-9, abs=1e-12)
    assert fit.pruned == pytest.approx(float((xp @ w_p.t()).pow(2).sum() / n), rel=1e-9)
    assert fit.unexplained < fit.pruned


@pytest.mark.unit
@pytest.mark.parametrize("intercept", [True, False])
def test_system_energy_equals_the_fit_for_every_pruned_set(intercept):
    """The scorer's one-inverse Schur energy equals fit_layer's for any P."""
    x, w = samples(seed=2), weight(3)
    mu, s = refit.second_moment(*sums(x), intercept)
    sys = refit.system(w.t() @ w, mu if intercept else None, s, 1e-2)
    for heads in ([0], [2], [0, 3], [1, 2, 3], []):
        p = channels(heads)
        fit = refit.fit_layer(w, mu if intercept else None, s, p, 1e-2)
        assert sys.unexplained(p) == pytest.approx(fit.unexplained, rel=1e-9, abs=1e-12), heads


@pytest.mark.unit
def test_no_pruned_channel_is_the_identity():
    x, w = samples(), weight()
    mu, s = refit.second_moment(*sums(x), True)
    fit = refit.fit_layer(w, mu, s, torch.zeros(D, dtype=torch.bool), 1e-3)
    assert not fit.delta_w.any() and not fit.delta_b.any() and fit.unexplained == 0


@pytest.mark.unit
def test_a_duplicated_channel_block_is_rebuilt_exactly():
    """x_P a linear map of x_K: refit (tiny ridge) rebuilds W_P x_P on every sample, and E(P) ~ 0."""
    x = samples()
    r = torch.randn(HD, HD, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x[:, 2 * HD:3 * HD] = x[:, 0:HD] @ r.t()  # head 2 = R (head 0)
    w, p = weight(), channels([2])
    for intercept in (True, False):
        mu, s = refit.second_moment(*sums(x), intercept)
        fit = refit.fit_layer(w, mu if intercept else None, s, p, 1e-12)
        w_new = w + fit.delta_w
        w_new[:, p] = 0
        rebuilt = x @ w_new.t() + (0 if fit.delta_b is None else fit.delta_b)
        torch.testing.assert_close(rebuilt, x @ w.t(), rtol=0, atol=1e-7)
        assert fit.unexplained < 1e-9 * fit.pruned


@pytest.mark.unit
def test_singular_and_ill_conditioned_systems_are_errors_not_nan():
    x = samples(n=5)  # 5 samples of 12 channels: S_KK has rank <= 5
    mu, s = refit.second_moment(*sums(x), False)
    with pytest.raises(refit.RefitError, match="singular .*set surgery.ridge > 0"):
        refit.fit_layer(weight(), None, s, channels([0]), 0.0, layer=3)
    with pytest.raises(refit.RefitError, match="ill-conditioned .*raise surgery.ridge"):
        refit.fit_layer(weight(), None, s, channels([0]), 1e-15, layer=3)
    with pytest.raises(refit.RefitError, match="12 output-projection channels from only 5 calibration tokens"):
        refit.check_tokens(5, 12, 0)
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(refit.RefitError, match="NaN/inf"):
        refit.fit_layer(weight(), None, bad, channels([0]), 1e-3)
    with pytest.raises(refit.RefitError, match="every head is pruned"):
        refit.fit_layer(weight(), None, s, torch.ones(D, dtype=torch.bool), 1e-3)
    with pytest.raises(refit.RefitError, match="singular"):
        refit.system(weight().t() @ weight(), None, s, 0.0).unexplained(channels([0]))


@pytest.mark.unit
def test_dead_kept_heads_fall_back_to_mean_or_nothing():
    """Kept heads that write nothing cannot take anything over: A = 0, finite (documented fallback)."""
    x = samples()
    x[:, HD:] = 0  # only head 0 writes; it is pruned
    w, p = weight(), channels([0])
    for intercept in (True, False):
        mu, s = refit.second_moment(*sums(x), intercept)
        fit = refit.fit_layer(w, mu if intercept else None, s, p, 1e-3)
        assert torch.isfinite(fit.delta_w).all() and not fit.delta_w.any()
        if intercept:  # mean compensation exactly
            torch.testing.assert_close(fit.delta_b, w[:, p] @ mu[p], rtol=0, atol=1e-12)
        assert fit.unexplained == pytest.approx(fit.pruned, rel=1e-9)
    silent = torch.zeros(50, D, dtype=torch.float64) + 2.0  # a layer writing one constant
    mu, s = refit.second_moment(*sums(silent), True)
    fit = refit.fit_layer(w, mu, s, p, 1e-3)
    assert not fit.delta_w.any() and torch.isfinite(fit.delta_b).all() and fit.unexplained == 0
    assert refit.system(w.t() @ w, mu, s, 1e-3).unexplained(p) == 0


# --------------------------------------------------------------------------- models


def logits(model, batch):
    with torch.no_grad():
        out = forward(model, batch.input_ids, batch.attention_mask)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def outputs_of(model, batch, family):
    spec = SinkSpec("first") if family in CAUSAL else SinkSpec("ids", ids=(1,))
    return capture_stats(model, batch, spec, config=CaptureConfig(metrics=(), outputs=True)).outputs


def copy_head(model, family: str, layer: int, src: int, dst: int, value_map: torch.Tensor | None = None) -> None:
    """Make head `dst` attend like `src` and write value_map @ (src's values): o_dst = value_map o_src."""
    g = arch.geometry(model)
    ad = arch.adapter_for(model)
    block = arch.blocks(model)[layer]
    hd = g.head_dim

    def rows(h):
        return slice(h * hd, (h + 1) * hd)

    m = torch.eye(hd) if value_map is None else value_map
    with torch.no_grad():
        if ad.qkv_layout == "separate":  # (out, in) Linear weights; GQA: only query heads of one group
            q, k, v = (arch.get(block, p) for p in (ad.q, ad.k, ad.v))
            q.weight[rows(dst)] = q.weight[rows(src)]
            if q.bias is not None:
                q.bias[rows(dst)] = q.bias[rows(src)]
            if g.group_size == 1:
                k.weight[rows(dst)] = k.weight[rows(src)]
                v.weight[rows(dst)] = m @ v.weight[rows(src)]
                for lin, mm in ((k, torch.eye(hd)), (v, m)):
                    if lin.bias is not None:
                        lin.bias[rows(dst)] = mm @ lin.bias[rows(src)]
            else:
                assert value_map is None and src // g.group_size == dst // g.group_size
        else:  # GPT-2 Conv1D c_attn: weight (in, 3 * D) laid out [q | k | v]
            w, b = arch.get(block, ad.qkv).weight, arch.get(block, ad.qkv).bias
            width = g.n_heads * hd
            for part, mm in ((0, torch.eye(hd)), (1, torch.eye(hd)), (2, m)):
                def cs(h):
                    return slice(part * width + h * hd, part * width + (h + 1) * hd)

                w[:, cs(dst)] = w[:, cs(src)] @ mm.t()
                b[cs(dst)] = mm @ b[cs(src)]


@pytest.mark.integration
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "gemma3_text"])
def test_no_head_pruned_is_the_identity(family):
    model, batch = tiny_model(family), pad(ragged_batch(seed=1), 0)
    before = logits(model, batch)
    comp = compensate(model, {0: [], 1: []}, outputs_of(model, batch, family), "refit")
    assert not comp
    with surgery.masked(model, {0: [], 1: []}, comp):
        assert torch.equal(logits(model, batch), before)
    w = refit_layer(model, 0, [], outputs_of(model, batch, family)[0], 1e-3)
    assert not w.delta_w.any()


@pytest.mark.integration
@pytest.mark.parametrize("family,heads,value_map", [
    ("gpt2", {0: [2], 1: [3]}, False), ("gpt2", {0: [2]}, True), ("bert", {0: [2], 1: [3]}, True),
    ("llama", {0: [1, 3], 1: [1, 3]}, False), ("mistral", {0: [1], 1: [3]}, False)])
def test_heads_the_kept_ones_rebuild_exactly_leave_the_outputs_unchanged(family, heads, value_map):
    """A duplicated head, or one writing a linear map of a kept head's output: refit recovers it (1e-5)."""
    model = tiny_model(family)
    g = torch.Generator().manual_seed(7)
    for layer, hs in heads.items():
        for h in hs:
            src = h - 1  # in the same GQA group for the Llama-style families
            r = torch.randn(arch.geometry(model).head_dim, arch.geometry(model).head_dim, generator=g) \
                if value_map else None
            copy_head(model, family, layer, src, h, r)
    batch = pad(ragged_batch(seed=3, n=12, max_len=30), 0)
    full = logits(model, batch)
    comp = compensate(model, heads, outputs_of(model, batch, family), "refit", ridge=1e-10)
    assert set(comp.weight) == set(heads) and (bool(comp.bias) == (family in ("gpt2", "bert")))
    with surgery.masked(model, heads, comp):
        torch.testing.assert_close(logits(model, batch), full, rtol=0, atol=1e-5)
    with surgery.masked(model, heads, compensate(model, heads, outputs_of(model, batch, family), "mean")):
        assert not torch.allclose(logits(model, batch), full, atol=1e-3)  # what refit recovered mattered
    fresh = tiny_model(family)
    fresh.load_state_dict(model.state_dict())
    surgery.mask_heads(fresh, heads, comp)
    torch.testing.assert_close(logits(fresh, batch), full, rtol=0, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "qwen2", "gemma3_text"])
def test_refit_mask_equals_remove_equals_vanilla_reload(family, tmp_path):
    """Scoped mask == permanent mask == removal == the saved checkpoint reloaded (1e-5); no config change
    without an output-projection bias (Llama: no attention_bias)."""
    from test_surgery import heads_for

    batch = pad(ragged_batch(seed=5), 0)
    heads = heads_for(family)
    ref = tiny_model(family)
    comp = compensate(ref, heads, outputs_of(ref, batch, family), "refit")
    assert comp.kind == "refit" and set(comp.fits) == set(heads)
    with surgery.masked(ref, heads, comp):
        scoped = logits(ref, batch)
    with surgery.masked(ref, heads):
        assert not torch.allclose(logits(ref, batch), scoped, atol=1e-4)  # the refit changed something
    dense, removed = tiny_model(family), tiny_model(family)
    surgery.mask_heads(dense, heads, comp)
    surgery.remove_heads(removed, heads, comp)
    torch.testing.assert_close(logits(dense, batch), scoped, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(removed, batch), scoped, rtol=0, atol=1e-5)
    assert not getattr(dense.config, "attention_bias", False)
    assert not getattr(dense, "_pruner_bias_not_in_config", False)
    assert all((arch.o_bias(dense, i) is None) == (family in ("llama", "qwen2", "gemma3_text")) for i in range(2))
    tok = word_tokenizer()
    assert folders.save_checkpoint(dense, tok, tmp_path / "dense", removed=False).max_diff <= export.ATOL
    if family == "llama":  # uniform: 2 of 4 heads over 2 KV heads in each layer, explicit head_dim: compact saves
        uniform = {0: [1, 3], 1: [1, 3]}
        removed = tiny_model(family)
        surgery.remove_heads(removed, uniform, compensate(ref, uniform, outputs_of(ref, batch, family), "refit"))
        saved = folders.save_checkpoint(removed, tok, tmp_path / "compact", removed=True)
        assert saved.max_diff <= export.ATOL and saved.layout == "vanilla"
        import json
        cfg = json.loads((tmp_path / "compact" / "config.json").read_text())
        assert cfg["num_attention_heads"] == 2 and cfg["attention_bias"] is False


def word_tokenizer():
    """A small tokenizer the checkpoints can be saved with (the tiny models need none to run)."""
    from transformers import AutoTokenizer

    from pruner.core import assets

    return AutoTokenizer.from_pretrained(assets.checkpoint("gpt2-shakespeare"))


@pytest.mark.integration
def test_compensation_file_round_trips_and_reads_old_bias_only_files(tmp_path):
    model, batch = tiny_model("gpt2"), pad(ragged_batch(), 0)
    heads = {0: [1], 1: [0, 2]}
    comp = compensate(model, heads, outputs_of(model, batch, "gpt2"), "refit")
    folders.save_compensation(comp, tmp_path / "c.safetensors")
    back = folders.load_compensation(tmp_path / "c.safetensors")
    assert back.kind == "refit" and back.bias.keys() == comp.bias.keys() == back.weight.keys() == {0, 1}
    for k in comp.weight:
        assert torch.equal(back.weight[k], comp.weight[k]) and torch.equal(back.bias[k], comp.bias[k])
    from safetensors.torch import save_file

    save_file({"layer.0": comp.bias[0]}, str(tmp_path / "old.safetensors"))  # a file from before refit
    old = folders.load_compensation(tmp_path / "old.safetensors")
    assert old.kind == "mean" and list(old.bias) == [0] and not old.weight
    folders.save_compensation(surgery.Compensation(), tmp_path / "zero.safetensors")
    assert not (tmp_path / "zero.safetensors").exists()


@pytest.mark.integration
def test_sequential_refit_first_layer_equals_one_shot_and_later_layers_see_the_pruned_model():
    model, batch = tiny_model("gpt2"), pad(ragged_batch(seed=2, n=10), 0)
    heads = {0: [1, 2], 1: [0]}

    def collect():
        return outputs_of(model, batch, "gpt2")

    calls = []
    seq = refit_sequential(model, heads, lambda: calls.append(1) or collect())
    one = compensate(model, heads, collect(), "refit")
    assert len(calls) == 2
    torch.testing.assert_close(seq.weight[0], one.weight[0], rtol=0, atol=1e-6)  # nothing pruned below layer 0
    assert not torch.allclose(seq.weight[1], one.weight[1], atol=1e-4)
    # on the calibration data the sequential fit of the last layer leaves no more than the one-shot one
    with surgery.masked(model, heads, seq):
        nll_seq = logits(model, batch)
    assert torch.isfinite(nll_seq).all()


@pytest.mark.integration
@pytest.mark.parametrize("family,ridge", [("gpt2", 1e-3), ("llama", "auto")])
def test_one_pass_sequential_refit_equals_the_pass_per_layer_one(family, ridge):
    """Each block refitted as it is captured, its pruned outputs fed forward: the fits (and chosen ridges) of
    re-capturing the whole model once per pruned layer, to the float32 rounding of the forwarded states (the
    model's attention against the capture's kernel), with every block run twice instead of L captures."""
    from pruner.core.layerwise import PassOptions, Resident
    from pruner.pruning.layerwise import RefitOptions, refit_one_pass

    model, batch = tiny_model(family), pad(ragged_batch(seed=3, n=7), 0)
    heads = {0: [1], 1: [0, 2]}
    cfg = CaptureConfig(metrics=(), outputs=True, folds=3 if ridge == "auto" else 0)
    last, calls = {}, []

    def collect():
        calls.append(1)
        last["stats"] = capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=2)
        return last["stats"].outputs

    ref = refit_sequential(model, heads, collect, ridge, lambda: last["stats"].folds)
    blocks = arch.blocks(model)
    runs = {i: 0 for i in range(len(blocks))}
    hooks = [b.register_forward_hook(lambda m, a, out, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, b in enumerate(blocks)]
    one = refit_one_pass(model, heads, batch, SinkSpec("first"), None, Resident(model, "cpu"),
                         RefitOptions(ridge=ridge, folds=3), PassOptions(batch_size=2))
    for h in hooks:
        h.remove()
    assert len(calls) == 2 and runs == {0: 8, 1: 8}  # 4 batches, twice through each pruned block
    assert one.weight.keys() == ref.weight.keys() == {0, 1} and one.bias.keys() == ref.bias.keys()
    torch.testing.assert_close(one.weight[0], ref.weight[0], rtol=0, atol=0)  # nothing pruned below layer 0
    torch.testing.assert_close(one.weight[1], ref.weight[1], rtol=0, atol=1e-4 * float(ref.weight[1].abs().max()))
    assert [f.get("ridge") for f in one.fits.values()] == [f.get("ridge") for f in ref.fits.values()]
    with surgery.masked(model, heads, ref):
        expected = logits(model, batch)
    with surgery.masked(model, heads, one):  # it prunes like the reference
        torch.testing.assert_close(logits(model, batch), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.integration
def test_refit_aware_scorer_prices_a_duplicated_head_at_zero_and_selects_it():
    """A head and its exact copy: either is rebuilt from the other, so it costs (nearly) nothing.

    The ridge (1e-6 of the mean diagonal) sits above the float32 rounding of the moments' products
    (the copy's zero eigenvalues come out at about -2e-9 of the largest): smaller, and whether the
    system factors depends on the machine's rounding, not on the method."""
    from pruner.pruning.calibrate import CalibrationOptions, calibrate
    from pruner.pruning.scoring import get_scorer
    from pruner.pruning.selection import SelectionConfig, select

    model = tiny_model("gpt2")
    copy_head(model, "gpt2", 1, 0, 3)
    batch = pad(ragged_batch(seed=3, n=12, max_len=30), 0)
    inputs = calibrate(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=("cosine",), outputs=True),
                       options=CalibrationOptions(ridge=1e-6))
    scores = get_scorer("refit-energy")(inputs, torch.ones(2, 4, dtype=torch.bool))
    others = torch.cat([scores[0], scores[1, 1:3]])
    assert max(scores[1, 3], scores[1, 0]) < 1e-4 * others.min()  # either twin is (nearly) free
    plan = select(get_scorer("refit-energy"), inputs, arch.geometry(model), SelectionConfig(target=2))
    first = plan.entries[0]
    assert (first.layer, first.head) in ((1, 0), (1, 3))
    assert (plan.entries[1].layer, plan.entries[1].head) not in ((1, 0), (1, 3))  # never both twins
    assert len(inputs.refit_systems()) == 2 and inputs.intercept == (True, True) and inputs.ridge == 1e-6


# --- ridge auto: cross-validation over calibration folds (docs/design.md §8.2) -------------------------


def fold_sums(x: torch.Tensor, k: int):
    """(joint (K, D, D), o (K, D), n (K,)) of rows assigned to fold i mod k."""
    parts = [x[i::k] for i in range(k)]
    return (torch.stack([p.t() @ p for p in parts]), torch.stack([p.sum(0) for p in parts]),
            torch.tensor([float(len(p)) for p in parts], dtype=torch.float64))


@pytest.mark.unit
@pytest.mark.parametrize("intercept", [True, False])
def test_heldout_energy_equals_fitting_without_the_fold_and_measuring_on_it(intercept):
    """Every ridge of the grid from one eigendecomposition equals the direct computation: fit on the other
    folds' rows (closed form), predict the held-out rows, W_P-weighted squared error averaged (1e-8)."""
    x, w, p = samples(n=300, seed=4), weight(), channels([0, 2])
    joint, o, n = fold_sums(x, 3)
    grid = (1e-4, 1e-2, 1.0, float("inf"))
    got = refit.heldout_energies(w, joint, o, n, p, intercept, grid)
    for f in range(3):
        train = torch.cat([x[i::3] for i in range(3) if i != f])
        test = x[f::3]
        mu, s = refit.second_moment(train.sum(0), train.t() @ train, len(train), intercept)
        for i, rel in enumerate(grid):
            fit = refit.fit_layer(w, mu if intercept else None, s, p, rel)
            err = (test @ fit.delta_w.t() - test[:, p] @ w[:, p].t())  # the kept part's correction minus the loss
            if intercept:
                err = err + fit.delta_b
            want = err.square().sum(-1).mean()
            assert got[f, i].item() == pytest.approx(want.item(), rel=1e-8)


@pytest.mark.unit
def test_ridge_choice_takes_the_largest_within_one_standard_error():
    x, w, p = samples(n=300, seed=5), weight(), channels([1])
    joint, o, n = fold_sums(x, 4)
    choice = refit.choose_ridge(w, joint, o, n, p, True)
    best = min(choice.heldout)
    i = choice.grid.index(choice.ridge)
    assert choice.heldout[i] <= best + choice.spread[choice.heldout.index(best)]
    assert all(h > best + choice.spread[choice.heldout.index(best)] for h in choice.heldout[i + 1:])


@pytest.mark.integration
def test_infinite_ridge_is_mean_compensation():
    """ridge -> infinity: no regression, the intercept alone; on a model with biases that is mean compensation
    (the masked model's logits to 1e-6)."""
    model = tiny_model("gpt2")
    batch = pad(ragged_batch(seed=3, n=12, max_len=30), 0)
    outputs = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=(), outputs=True)).outputs
    heads = {0: [1, 2], 1: [3]}
    ids = batch.input_ids[:3]
    logits = {}
    for name, comp in (("mean", compensate(model, heads, outputs, "mean")),
                       ("inf", compensate(model, heads, outputs, "refit", float("inf")))):
        with surgery.masked(model, heads, comp), torch.no_grad():
            logits[name] = forward(model, ids, torch.ones_like(ids)).logits
    torch.testing.assert_close(logits["inf"], logits["mean"], rtol=0, atol=1e-6)


@pytest.mark.integration
def test_a_twin_head_gets_a_small_ridge_and_ordinary_heads_a_larger_one():
    """A head the others rebuild exactly (a copy) is refitted with the smallest ridges of the grid; a head with
    nothing to rebuild it from is not."""
    model = tiny_model("gpt2")
    copy_head(model, "gpt2", 1, 0, 3)
    batch = pad(ragged_batch(seed=3, n=40, min_len=20, max_len=30), 0)
    stats = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=(), outputs=True, folds=4))
    from pruner.pruning.compensation import choose_layer_ridge

    twin = choose_layer_ridge(model, 1, [3], stats.folds[1])
    assert twin.ridge <= 1e-4 and twin.best < 1e-3 * twin.heldout[-1]  # rebuilt: held-out energy ~ 0
    other = choose_layer_ridge(model, 0, [2], stats.folds[0])
    assert other.ridge > twin.ridge


@pytest.mark.integration
def test_fold_moments_add_up_and_do_not_depend_on_the_batch_size():
    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=3, n=13, max_len=30), 0)
    cfg = CaptureConfig(metrics=(), outputs=True, folds=3)
    a = capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=2)
    b = capture_stats(model, batch, SinkSpec("first"), config=cfg, batch_size=5)
    for la, lb in zip(a.folds, b.folds):
        assert torch.equal(la.tokens, lb.tokens)
        # float32 products on rows centred per batch and fold: batches change the rounding, not the sums
        torch.testing.assert_close(la.joint, lb.joint, rtol=0, atol=1e-6 * float(la.joint.abs().max()))
    for layer, out in enumerate(a.outputs):
        torch.testing.assert_close(a.folds[layer].joint.sum(0), out.joint, rtol=1e-12, atol=0)
        assert float(a.folds[layer].tokens.sum()) == float(out.tokens)
    tokens = batch.attention_mask.sum(-1)
    assert a.folds[0].tokens.tolist() == [float(tokens[i::3].sum()) for i in range(3)]


@pytest.mark.unit
def test_too_few_calibration_tokens_per_channel_is_a_warning_that_says_how_many():
    assert refit.token_advice(3840, 384) is None
    advice = refit.token_advice(2048, 384)
    assert "384 output-projection channels" in advice and "3,840 or more" in advice and "num_samples" in advice


@pytest.mark.unit
@pytest.mark.parametrize("intercept", [True, False])
def test_marginal_costs_from_one_inverse_equal_a_fresh_inverse_per_candidate(intercept):
    """The refit-aware scorer's bordered-inverse update: E(P + h) - E(P) for every candidate equals the Schur
    energy of each enlarged set computed afresh (1e-9)."""
    x, w = samples(), weight()
    mu, s = refit.second_moment(*sums(x), intercept)
    sys = refit.system(w.t() @ w, mu if intercept else None, s, 1e-3)
    for pruned_heads in ([], [1], [0, 3]):
        pruned = channels(pruned_heads)
        cands = [h for h in range(H) if h not in pruned_heads]
        got = refit.marginal_costs(sys, pruned, [torch.arange(h * HD, (h + 1) * HD) for h in cands])
        for h, g in zip(cands, got):
            want = sys.unexplained(pruned | channels([h])) - sys.unexplained(pruned)
            assert g == pytest.approx(max(want, 0.0), rel=1e-9, abs=1e-12)
