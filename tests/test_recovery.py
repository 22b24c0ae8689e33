"""Recovery: the distillation loss, what each method trains, the guard, resume, and `pruner recover` on a shipped
run with its refusals (docs/recovery.md)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import pruner
from pruner.core import resume
from pruner.pruning import surgery
from pruner.recovery import loss
from pruner.recovery.data import RecoveryError
from pruner.recovery.spec import RecoverySpec
from tests.tiny import tiny_model

QUICK = {"tokens": 512, "length": 16, "batch_size": 4, "lr": 1e-3, "eval_every": 128}


def texts(n: int = 300, seed: int = 0) -> list[str]:
    words = "the king queen a of and to is was my lord good".split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n)]


@pytest.mark.unit
def test_kl_is_zero_on_itself_and_matches_torch():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    zero, n = loss.full_kl(t, t, mask)
    assert abs(float(zero)) < 1e-6 and int(n) == 7
    kl, _ = loss.full_kl(s, t, mask)
    ref = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl, (ref * mask).sum())


@pytest.mark.unit
@pytest.mark.parametrize("route", ["head in slices", "whole logits"])
def test_one_paired_pass_gives_each_models_perplexity_and_the_mean_kl_over_the_counted_positions(
        word_tokenizer, route, monkeypatch):
    from pruner.evaluation import perplexity
    from pruner.evaluation.perplexity import sliding_windows, window_scores
    from pruner.runs.recovery_stage import scores

    if route == "head in slices":
        monkeypatch.setattr(perplexity, "LOGIT_BYTES", 4 * 64 * 3)  # 3 positions of a 64-token vocabulary a slice
    else:
        monkeypatch.setattr(perplexity, "_plain_head", lambda model: None)  # the model's own logits, whole

    teacher = tiny_model("llama").eval()  # its vocabulary holds the word tokenizer's ids
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.lm_head.weight.mul_(0.5)  # a flatter student
    w = sliding_windows(word_tokenizer, texts(7), 16)  # the last window is short: padded, its pads unlabelled
    assert (w.labels[-1] == -100).sum() > 1
    assert scores(teacher, teacher, w)[2] == pytest.approx(0, abs=1e-6)
    total = count = 0.0
    for ids, mask, lab in zip(w.input_ids, w.attention_mask, w.labels):  # one window, one position at a time
        t = teacher(input_ids=ids[None], attention_mask=mask[None]).logits[0].double().log_softmax(-1)
        s = student(input_ids=ids[None], attention_mask=mask[None]).logits[0].double().log_softmax(-1)
        for pos in range(len(ids) - 1):
            if lab[pos + 1] != -100:
                total, count = total + float((t[pos].exp() * (t[pos] - s[pos])).sum()), count + 1
    base, pruned, kl = scores(teacher, student, w)
    assert kl == pytest.approx(total / count, rel=1e-4)
    for (nll, n), model in ((base, teacher), (pruned, student)):  # what the perplexity pass of each gives
        want, want_n = window_scores(model, w, causal=True)[:2]
        assert torch.equal(n, want_n) and int(n.sum()) == count
        torch.testing.assert_close(nll, want, rtol=1e-5, atol=1e-5)
    assert scores(teacher, student, w, base=False)[0] is None
    assert scores(teacher, student, None) == (None, None, None)


@pytest.mark.unit
def test_topk_kl_is_the_full_kl_with_every_token_and_a_lower_bound_with_fewer():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 6, 40, generator=g), torch.randn(2, 6, 40, generator=g) * 3
    mask = torch.ones(2, 6)
    full, _ = loss.full_kl(s, t, mask)
    every, _ = loss.topk_kl(s, *loss.topk_targets(t, 40), mask)
    torch.testing.assert_close(every, full, rtol=1e-4, atol=1e-5)
    few, _ = loss.topk_kl(s, *loss.topk_targets(t, 8), mask)
    assert 0 < float(few) <= float(full) + 1e-5  # the collapsed distributions' KL


@pytest.mark.unit
def test_tail_samples_estimate_the_full_kl_where_the_collapsed_tail_cannot_see_the_drift():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(1, 3, 60, generator=g) * 2
    top, idx, tail = loss.topk_targets(t, 6)
    # a student equal to the teacher on its top 6 tokens and on the tail's total mass, but spread differently there
    s_lp = loss.log_probs(t).clone()
    outside = torch.ones_like(s_lp, dtype=torch.bool).scatter(-1, idx.long(), False)
    flat = torch.where(outside, torch.randn(s_lp.shape, generator=g) * 3, torch.full_like(s_lp, -torch.inf))
    s_lp = torch.where(outside, flat.log_softmax(-1) + tail[..., None], s_lp)
    mask = torch.ones(1, 3)
    full, _ = loss.full_kl(s_lp, t, mask)
    collapsed, _ = loss.topk_kl(s_lp, top, idx, tail, mask)
    assert float(collapsed) < 1e-4 < 0.1 < float(full)  # the collapsed bin is blind to the tail's drift
    samples = loss.tail_samples(t, idx, 20000, torch.Generator().manual_seed(3))
    assert samples[0].dtype == torch.int32 and samples[0].shape == (1, 3, 20000)
    assert not torch.isin(samples[0][0, 0], idx[0, 0]).any()  # drawn from the tail only
    estimate, _ = loss.topk_kl(s_lp, top, idx, tail, mask, samples=samples)
    torch.testing.assert_close(estimate, full, rtol=0.03, atol=1e-3)  # unbiased: the mean of many samples


@pytest.mark.unit
def test_an_empty_tail_gives_the_exact_kl_with_samples_too():
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(2, 4, 12, generator=g), torch.randn(2, 4, 12, generator=g)
    top, idx, tail = loss.topk_targets(t, 12)
    samples = loss.tail_samples(t, idx, 3, torch.Generator().manual_seed(0))
    exact, _ = loss.topk_kl(s, top, idx, tail, torch.ones(2, 4), samples=samples)
    torch.testing.assert_close(exact, loss.full_kl(s, t, torch.ones(2, 4))[0], rtol=1e-4, atol=1e-5)


@pytest.mark.unit
def test_half_precision_logits_give_a_finite_float32_loss():
    s = (torch.randn(1, 4, 50) * 30).to(torch.bfloat16)
    t = (torch.randn(1, 4, 50) * 30).to(torch.float16)
    kl, _ = loss.full_kl(s, t, torch.ones(1, 4))
    assert kl.dtype == torch.float32 and torch.isfinite(kl)


@pytest.mark.unit
def test_the_spec_refuses_an_unknown_method_and_a_budget_below_one_batch():
    from pruner.recovery.data import counts
    from pruner.runs.recipe import RecipeError
    from pruner.runs.recipe_io import validate_section

    with pytest.raises(RecipeError, match="unknown recovery method 'qlora'; valid: full, blocks, lora, attention"):
        validate_section("recovery", {"method": "qlora"})
    with pytest.raises(RecoveryError, match="below one batch"):
        counts(RecoverySpec(tokens=100, batch_size=8, length=128))
    assert counts(RecoverySpec(tokens=4096, batch_size=8, length=128)) == (32, 2)


@pytest.mark.unit
def test_the_evaluation_text_is_refused_as_recovery_data():
    from pruner.recovery.data import check_overlap
    from pruner.runs.recipe import EvaluationSpec

    ev = EvaluationSpec()  # shakespeare:evaluation
    with pytest.raises(RecoveryError, match="overlaps the evaluation windows"):
        check_overlap(RecoverySpec(data="shakespeare:evaluation"), ev)
    check_overlap(RecoverySpec(data="shakespeare:train"), ev)
    check_overlap(RecoverySpec(), ev)  # generated


@pytest.mark.unit
def test_a_list_of_sources_is_checked_and_none_may_be_the_evaluation_text():
    from pruner.recovery.data import check_overlap
    from pruner.runs.recipe import EvaluationSpec, RecipeError
    from pruner.runs.recipe_io import validate_section

    assert RecoverySpec(data=["shakespeare:train"]).data == "shakespeare:train"  # a list of one is that source
    assert RecoverySpec(data=["shakespeare:train", "python-docs:dev"]).sources == ["shakespeare:train", "python-docs:dev"]
    assert RecoverySpec(data=["generated", "python-docs:dev"]).sources == ["generated", "python-docs:dev"]
    check_overlap(RecoverySpec(data=["generated", "python-docs:dev"]), EvaluationSpec())
    for bad, says in ((["generated", "generated"], "names a source twice"),
                      (["generated", "shakespeare:nope"], "shakespeare has the splits"),
                      (["shakespeare:train", "shakespeare:train"], "names a source twice"),
                      (["shakespeare:train", "shakespeare:nope"], "shakespeare has the splits"), ([], "one or more")):
        with pytest.raises(RecipeError, match=says):
            validate_section("recovery", {"data": bad})
    with pytest.raises(RecoveryError, match="shakespeare:evaluation overlaps the evaluation windows"):
        check_overlap(RecoverySpec(data=["python-docs:dev", "shakespeare:evaluation"]), EvaluationSpec())


@pytest.mark.unit
def test_a_mixture_gives_each_source_an_equal_share_interleaved(word_tokenizer, tmp_path):
    from pruner.commands.recover import values
    from pruner.recovery.data import from_source

    (tmp_path / "a.txt").write_text(" ".join(["the king"] * 400))
    (tmp_path / "b.txt").write_text(" ".join(["my lord"] * 400))
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    spec = RecoverySpec(data=[a, b], tokens=40 * 16, length=16, batch_size=4, seed=3)
    w = from_source(spec, word_tokenizer, 40, 5)
    king = word_tokenizer.convert_tokens_to_ids("king")

    def from_a(batch):  # (window,) True where the window is source a's text
        return (batch.input_ids == king).any(-1)

    assert w.train.input_ids.shape == (40, 16) and w.validation.input_ids.shape == (5, 16)
    assert int(from_a(w.train).sum()) == 20 and int(from_a(w.validation).sum()) == 3  # 5 = 3 + 2: the earlier first
    assert 0 < int(from_a(w.train)[:8].sum()) < 8  # interleaved: the first two batches hold both kinds of text
    assert w.source == f"{a}, {b}"
    again = from_source(spec, word_tokenizer, 40, 5)
    assert torch.equal(again.train.input_ids, w.train.input_ids)  # seeded
    args = type("Args", (), {"set": None, "tokens": None, "data": [a, b]})()
    assert values(args) == {"data": [a, b], "weights": None}  # sources named on the command line: equal shares
    args.set = ["recovery.weights=[3, 1]"]
    assert values(args) == {"data": [a, b], "weights": [3, 1]}


@pytest.mark.unit
def test_weights_share_a_mixture_and_a_zero_share_is_never_read(word_tokenizer, tmp_path):
    from pruner.recovery.data import from_source
    from pruner.runs.recipe import RecipeError
    from pruner.runs.recipe_io import validate_section

    (tmp_path / "a.txt").write_text(" ".join(["the king"] * 400))
    (tmp_path / "b.txt").write_text(" ".join(["my lord"] * 400))
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    king = word_tokenizer.convert_tokens_to_ids("king")
    spec = RecoverySpec(data=[a, b], weights=[3, 1], tokens=40 * 16, length=16, batch_size=4, seed=3)
    w = from_source(spec, word_tokenizer, 40, 5)
    assert int((w.train.input_ids == king).any(-1).sum()) == 30  # 3 of every 4 training windows
    assert int((w.validation.input_ids == king).any(-1).sum()) == 4  # 3.75 + 1.25: the larger remainder rounds up
    assert spec.shares() == [3, 1] and RecoverySpec(data=[a, b]).shares() == [1.0, 1.0]
    assert w.source == f"{a} ×3, {b} ×1"  # the shares in the run's record and summary line
    (tmp_path / "b.txt").unlink()  # a source with no share is not read
    only_a = from_source(RecoverySpec(data=[a, b], weights=[1, 0], length=16, batch_size=4), word_tokenizer, 40, 5)
    assert bool((only_a.train.input_ids == king).any(-1).all())
    for bad, says in (({"data": [a, "python-docs:dev"], "weights": [1]}, "1 weights for 2 sources"),
                      ({"data": [a, "python-docs:dev"], "weights": [1, -1]}, "must be >= 0"),
                      ({"data": [a, "python-docs:dev"], "weights": [0, 0]}, "sum to a positive"),
                      ({"data": a, "weights": [1]}, "recovery.data names one")):
        with pytest.raises(RecipeError, match=says):
            validate_section("recovery", bad)


@pytest.mark.unit
def test_generated_in_a_mixture_is_its_share_of_the_teachers_text(word_tokenizer, tmp_path):
    from pruner.recovery.data import Windows, from_source
    from pruner.core import data

    (tmp_path / "a.txt").write_text(" ".join(["the king"] * 400))
    a, asked = str(tmp_path / "a.txt"), []
    queen = word_tokenizer.convert_tokens_to_ids("queen")

    def generate(n_train, n_val):  # stands in for the teacher: windows of "queen" only
        asked.append((n_train, n_val))
        batch = lambda n: data.TokenBatch(torch.full((n, 16), queen), torch.ones(n, 16, dtype=torch.long))  # noqa: E731
        return Windows(batch(n_train), batch(n_val), "generated", 1.0)

    spec = RecoverySpec(data=["generated", a], tokens=40 * 16, length=16, batch_size=4, seed=3)
    w = from_source(spec, word_tokenizer, 40, 5, generate=generate)
    assert asked == [(20, 3)]  # the generated source's equal share, asked of the teacher once
    is_generated = (w.train.input_ids == queen).all(-1)
    assert int(is_generated.sum()) == 20 and int((w.validation.input_ids == queen).all(-1).sum()) == 3
    assert 0 < int(is_generated[:8].sum()) < 8  # interleaved with the file's windows
    assert w.source == f"generated, {a}"
    with pytest.raises(RecoveryError, match="needs the teacher"):
        from_source(spec, word_tokenizer, 40, 5)


def pair(family: str = "gpt2", heads=None, mode: str = "remove"):
    teacher = tiny_model(family)
    student = copy.deepcopy(teacher)
    heads = heads or {0: [0, 1, 2], 1: [1, 2, 3]}
    (surgery.remove_heads if mode == "remove" else surgery.mask_heads)(student, heads)
    return teacher, student, heads


@pytest.mark.integration
@pytest.mark.parametrize("method", ["full", "blocks", "lora", "attention"])
def test_each_method_lowers_the_validation_kl_and_returns_a_plain_model(word_tokenizer, method):
    teacher, student, _ = pair()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    out = pruner.recover(student, teacher, word_tokenizer, texts(), method=method, progress=False, **QUICK)
    r = out.record
    assert r["kept"] == "recovered" and r["validation_kl_best"] < 0.9 * r["validation_kl_pruned"], r
    after = dict(out.model.named_parameters())
    assert after.keys() == before.keys()  # LoRA merged: no adapter left, the pruned shape kept
    assert all(after[n].shape == before[n].shape for n in before)
    changed = {n for n in before if not torch.equal(after[n], before[n])}
    if method == "attention":
        assert changed and all(".attn." in n for n in changed), changed
    else:
        assert any(".mlp." in n for n in changed)
    if method == "blocks":  # the embeddings, the final norm and the head stay the base's
        assert changed and all(n.startswith("transformer.h.") for n in changed), changed
    elif method == "full":
        assert "transformer.wte.weight" in changed


@pytest.mark.integration
def test_a_dense_students_pruned_heads_stay_zero(word_tokenizer):
    from pruner.core import arch

    teacher, student, heads = pair(mode="mask")
    out = pruner.recover(student, teacher, word_tokenizer, texts(), progress=False, **QUICK)
    assert out.record["kept"] == "recovered"
    hd = arch.geometry(out.model).head_dim
    for layer, hs in heads.items():
        cols = arch.o_weight_cols(out.model, layer)
        for h in hs:
            assert torch.count_nonzero(cols[:, h * hd:(h + 1) * hd]) == 0


@pytest.mark.integration
def test_a_recovery_that_cannot_help_keeps_the_pruned_weights(word_tokenizer):
    teacher, student, _ = pair()
    before = copy.deepcopy(student.state_dict())
    out = pruner.recover(student, teacher, word_tokenizer, texts(), progress=False, **{**QUICK, "lr": 5.0})
    assert out.record["kept"] == "pruned" and "the pruned weights are kept" in out.record["note"]
    for k, v in out.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.integration
def test_a_student_thrown_off_restarts_from_the_pruned_weights_at_a_lower_rate(word_tokenizer):
    from pruner.recovery.train import BACKOFF, DRIFT

    teacher, student, _ = pair()

    def run(restarts, lr=1e-2):
        return pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), progress=False,
                              **{**QUICK, "lr": lr, "restarts": restarts}).record

    stuck, restarted = run(0), run(2)
    assert stuck["restarts"] == [] and stuck["kept"] == "pruned"  # 1e-2 throws this student off for good
    history = dict(restarted["validation_history"])
    assert restarted["restarts"] == [[2, pytest.approx(1e-2 * BACKOFF)]]  # once: the passes after it stay below 2x
    assert history[2] > DRIFT * restarted["validation_kl_pruned"] and history[2] == dict(stuck["validation_history"])[2]
    assert restarted["lr"] == pytest.approx(1e-2 * BACKOFF) and "restarted from the pruned weights" in restarted["note"]
    assert restarted["kept"] == "recovered" and restarted["validation_kl_best"] < restarted["validation_kl_pruned"]
    capped = run(1, lr=3e-2)  # still thrown off after its one restart: no second one
    after = [v for k, v in capped["validation_history"] if k > capped["restarts"][0][0]]
    assert len(capped["restarts"]) == 1 and max(after) > DRIFT * capped["validation_kl_pruned"]


class Killed(Exception):
    pass


@pytest.mark.integration
@pytest.mark.parametrize("lr", [1e-3, 1e-2])  # 1e-2: restarted at step 2, so the checkpoint holds the restarted AdamW
def test_resume_gives_the_uninterrupted_weights(word_tokenizer, tmp_path, monkeypatch, lr):
    opts = {**QUICK, "save_every": 128, "progress": False, "lr": lr}
    teacher, student, _ = pair()
    whole = pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), **opts)
    assert len(whole.record["restarts"]) == (lr > 5e-3)
    whole = whole.model

    def point(name: str) -> None:
        if name == "recovery:5":
            raise Killed(name)
    monkeypatch.setattr(resume, "kill_point", point)
    with pytest.raises(Killed):
        pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), checkpoint_dir=tmp_path, **opts)
    saved = torch.load(next(tmp_path.glob("state/rank-0/recovery.pt")), weights_only=True)
    assert saved["step"] == 4  # the checkpoint before the interruption
    monkeypatch.undo()
    resumed = pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), checkpoint_dir=tmp_path, **opts)
    assert resumed.record["steps_run"] == resumed.record["steps"] - 4
    want, got = whole.state_dict(), resumed.model.state_dict()
    assert list(got) == list(want)
    for n, a in want.items():
        assert torch.equal(a, got[n]), n  # bit for bit


@pytest.mark.integration
def test_cached_teacher_recovers_close_to_the_resident_one(word_tokenizer):
    teacher, student, _ = pair()
    res = pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), progress=False, **QUICK)
    cac = pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), progress=False,
                         teacher_mode="cached", top_k=64, **QUICK)  # k = the whole vocabulary here: the same loss
    assert cac.record["teacher"] == "cached"
    assert abs(cac.record["validation_kl_best"] - res.record["validation_kl_best"]) < 1e-3
