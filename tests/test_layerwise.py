"""Layer-by-layer calibration (`capture.onload: sequential`, docs/design.md §8.3): the same statistics and the same
plans as the all-resident pass, with one block in memory at a time, read from the checkpoint's safetensors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sequential import LayerEnd, capture_layerwise
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints.lazy import lazy_model
from pruner.checkpoints.storage import CheckpointError, check_shards
from pruner.cli import main
from pruner.core import assets, shapes
from pruner.core.data import TextSource, load_texts, pad, token_windows
from pruner.core.layerwise import PassOptions, Resident

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=8", "--set", "evaluation.bootstrap=20",
         "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]


def worst_relative(a, b) -> float:
    """Largest relative difference over every sum of two HeadStats (per-head fields, pairs, moments, folds)."""
    out = 0.0
    pairs = [(getattr(a, f), getattr(b, f)) for f in ("sink_mass", "entropy_full", "entropy_content", "g", "rest",
                                                       "dormancy", "rows", "content_rows")]
    assert a.pairs.keys() == b.pairs.keys()
    pairs += [(a.pairs[k], b.pairs[k]) for k in a.pairs]
    for part in ("residual", "outputs", "folds"):  # captured by both or by neither: none skipped unseen
        x, y = getattr(a, part), getattr(b, part)
        assert (x is None) == (y is None) and (x is None or part == "residual" or len(x) == len(y)), part
    if a.residual is not None:
        pairs.append((a.residual, b.residual))
    for x, y in zip(a.outputs or [], b.outputs or []):
        pairs += [(x.joint, y.joint), (x.o, y.o), (x.u, y.u), (x.oo, y.oo), (x.uu, y.uu), (x.ww, y.ww),
                  (x.tokens, y.tokens)]
    for x, y in zip(a.folds or [], b.folds or []):
        pairs += [(x.joint, y.joint), (x.tokens, y.tokens)]
    for x, y in pairs:
        assert x.shape == y.shape
        if x.numel():  # the channels' second moments are empty unless captured
            out = max(out, float((x - y).abs().max() / x.abs().max().clamp_min(1e-300)))
    return out


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2", "gpt_neox", "bert"])
def test_layer_by_layer_equals_all_resident_on_every_family(family, side):
    """Left padding too: the blocks must get the model's own attention mask (GPT-2 passes it by position)."""
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=3, n=13, max_len=30), 0, side)
    sinks = SinkSpec("first")
    cfg = CaptureConfig(metrics=("cosine", "js"), outputs=True, folds=3, channels=family == "llama")
    a = capture_stats(model, batch, sinks, config=cfg, batch_size=4)
    b = capture_layerwise(model, batch, sinks, None, cfg, Resident(model, "cpu"), PassOptions(batch_size=4))
    assert worst_relative(a, b) <= 1e-10
    assert bool(a.outputs[0].uu.numel()) == cfg.channels


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2", "gpt_neox", "bert"])
def test_blocks_one_at_a_time_give_the_whole_models_logits_with_left_padding(family):
    """Every block gets what the model itself passes it, by keyword or by position (GPT-2 passes its causal mask
    by position: without it, real tokens would attend to the left padding)."""
    from pruner.core import arch
    from pruner.core.layerwise import first_block_calls, replayed, run_blocks
    from pruner.core.runtime import forward

    model = tiny_model(family)
    batch = pad(ragged_batch(seed=5, n=6, max_len=24), 0, "left")
    ids, mask = batch.input_ids, batch.attention_mask
    calls = first_block_calls(model, [(ids, mask)], "cpu")
    run_blocks(Resident(model, "cpu"), calls, len(arch.blocks(model)), "cpu")
    with replayed(model) as replay:
        replay.hidden = calls[0].hidden
        got = forward(model, ids, mask)
    want = forward(model, ids, mask)
    got, want = (getattr(x, "logits", None) if hasattr(x, "logits") else x.last_hidden_state for x in (got, want))
    real = mask.bool()
    assert torch.equal(got[real], want[real])


@pytest.mark.parametrize("name", ["minilm-causal", "gpt2-shakespeare", "llama-shakespeare"])
def test_blocks_read_from_disk_give_the_same_statistics(name):
    """The shipped checkpoints, blocks read one at a time from their safetensors: equal sums, and nothing but the
    non-block weights left in memory afterwards."""
    from pruner.checkpoints import loading

    tok = loading.load_tokenizer(name)
    batch = token_windows(tok, load_texts(TextSource("shakespeare:calibration")), 64, num_samples=12)
    cfg = CaptureConfig(metrics=("cosine",), outputs=True)
    a = capture_stats(loading.load_model(name), batch, SinkSpec("first"), tok, config=cfg, batch_size=4)
    lazy = lazy_model(assets.resolve(name))
    b = capture_layerwise(lazy.model, batch, SinkSpec("first"), tok, cfg, lazy, PassOptions(batch_size=4))
    assert worst_relative(a, b) <= 1e-10
    from pruner.core import arch

    assert all(p.device.type == "meta" for block in arch.blocks(lazy.model) for p in block.parameters())


@pytest.mark.parametrize("name", ["minilm-causal", "gpt2-shakespeare", "llama-shakespeare"])
def test_perplexity_block_by_block_equals_the_whole_model(name):
    """Evaluation windows through one block at a time, read from disk, then the model's own final norm and LM
    head: the whole model's per-window NLLs bit for bit, for the base and for a plan under per-block scoped
    masks with mean compensation."""
    from pruner.checkpoints import loading
    from pruner.evaluation.perplexity import BlockwisePass, sliding_windows, window_scores
    from pruner.pruning import surgery
    from pruner.pruning.compensation import compensation_bias

    tok = loading.load_tokenizer(name)
    windows = sliding_windows(tok, load_texts(TextSource("shakespeare:evaluation")), 64, max_windows=10)
    model = loading.load_model(name)
    heads = {0: [1], 2: [0, 1]}
    outputs = capture_stats(model, token_windows(tok, load_texts(TextSource("shakespeare:calibration")), 64,
                                                 num_samples=4), SinkSpec("first"), tok,
                            config=CaptureConfig(metrics=(), outputs=True)).outputs
    comp = surgery.Compensation("mean", bias=compensation_bias(model, heads, outputs))
    base = window_scores(model, windows, 4)
    with surgery.masked(model, heads, comp):
        pruned = window_scores(model, windows, 4)
    lazy = lazy_model(assets.resolve(name))

    def scope(layer):
        return surgery.masked(lazy.model, {layer: heads[layer]} if layer in heads else {}, comp)

    assert torch.equal(window_scores(lazy.model, windows, 4, blocks=BlockwisePass(lazy))[0], base[0])
    got = window_scores(lazy.model, windows, 4, blocks=BlockwisePass(lazy, within=scope))
    assert torch.equal(got[0], pruned[0]) and torch.equal(got[1], pruned[1])
    assert not torch.equal(pruned[0], base[0])
    from pruner.core import arch

    assert all(p.device.type == "meta" for block in arch.blocks(lazy.model) for p in block.parameters())


def test_compare_block_by_block_never_loads_the_whole_model(tmp_path, monkeypatch):
    """`pruner compare` with the blocks on disk: calibration, compensation (mean, refit) and every plan's
    evaluation one block at a time -- the whole-model loader is never called -- and the records of the
    whole-model run, number for number."""
    from pruner.checkpoints import loading

    args = ["compare", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--scorers", "refit-energy,cosine",
            "--sparsities", "0.5", "--compensation", "zero,mean,refit", "--set", "capture.metrics=[cosine]"] + QUICK
    assert main(args + ["--out", str(tmp_path / "all"), "--set", "capture.onload=all"]) == 0

    def refuse(*a, **k):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(loading, "load_base", refuse)
    assert main(args + ["--out", str(tmp_path / "seq"), "--set", "capture.onload=sequential"]) == 0
    a, b = (json.loads((tmp_path / m / "compare.json").read_text()) for m in ("all", "seq"))
    ra, rb = (x["records"] if isinstance(x, dict) else x for x in (a, b))
    assert len(ra) == len(rb) == 6
    for x, y in zip(ra, rb):
        assert x["heads"] == y["heads"] and x["delta"] == pytest.approx(y["delta"], rel=1e-12, abs=1e-12)


def test_one_pass_sequential_refit_reads_blocks_from_disk():
    """Sequential refit, one pass: blocks read one at a time from the shipped checkpoint give the fits of the
    same pass over the model held in memory, bit for bit (ridge auto: the same ridges too)."""
    from pruner.checkpoints import loading
    from pruner.core.layerwise import Resident
    from pruner.pruning.layerwise import refit_one_pass

    name = "llama-shakespeare"
    tok = loading.load_tokenizer(name)
    batch = token_windows(tok, load_texts(TextSource("shakespeare:calibration")), 64, num_samples=12)
    heads = {0: [1, 3], 2: [0]}
    model = loading.load_model(name)
    a = refit_one_pass(model, heads, batch, SinkSpec("first"), tok, Resident(model, "cpu"),
                       options=PassOptions(batch_size=4))
    lazy = lazy_model(assets.resolve(name))
    b = refit_one_pass(lazy.model, heads, batch, SinkSpec("first"), tok, lazy, options=PassOptions(batch_size=4))
    assert a.weight.keys() == b.weight.keys() == {0, 2}
    assert all(torch.equal(a.weight[k], b.weight[k]) for k in a.weight) and a.fits == b.fits


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def same_plan(a: Path, b: Path) -> None:
    """The same heads in the same order, the same twins; the recorded scores to float32 rounding of the moments (a
    layer-by-layer calibration whose refit runs a pass of its own captures no fold moments, and the joint moments
    summed directly round differently from their sum over folds, by ~1e-8 of their scale, which a Schur complement
    of the refit-aware scorer amplifies to ~1e-6 of a marginal cost)."""
    pa, pb = json.loads(a.read_text()), json.loads(b.read_text())
    assert pa["heads"] == pb["heads"] and len(pa["entries"]) == len(pb["entries"])
    for x, y in zip(pa["entries"], pb["entries"]):
        assert {k: v for k, v in x.items() if not isinstance(v, float)} == \
            {k: v for k, v in y.items() if not isinstance(v, float)}
        assert y == pytest.approx(x, rel=1e-5, abs=1e-12)


def whole_then_by_block(tmp_path, monkeypatch, recipe: str, extra: list[str], after=None) -> dict[str, Path]:
    """`pruner prune` of a shipped recipe with the whole model, then with the blocks on disk and the whole-model
    loader patched to fail; `after(mode, out)` (asserted true) runs after each, under the same patch."""
    from pruner.checkpoints import loading

    runs = {}
    for mode in ("all", "sequential"):
        if mode == "sequential":
            monkeypatch.setattr(loading, "load_base", lambda *a, **k: (_ for _ in ()).throw(
                AssertionError("the whole model was loaded")))
        out = tmp_path / mode
        assert main(["prune", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(out),
                     "--set", f"capture.onload={mode}"] + extra + QUICK) == 0
        assert after is None or after(mode, out)
        runs[mode] = out
    return runs


@pytest.mark.parametrize("recipe", ["quickstart", "llama-shakespeare"])
def test_prune_and_export_layer_by_layer_never_load_the_whole_model(recipe, tmp_path, monkeypatch):
    """`pruner prune` with the blocks on disk -- calibration, perplexity, compensation, surgery and the written
    model/ one block at a time, the whole-model loader never called -- and then `pruner export` the same way:
    the plan, the perplexities and every written tensor of the whole-model run."""
    runs = whole_then_by_block(tmp_path, monkeypatch, recipe, [], lambda mode, out: main(
        ["export", str(out), "--format", "dense", "--out", str(tmp_path / f"dense-{mode}")]) == 0)
    same_plan(runs["all"] / "plan.json", runs["sequential"] / "plan.json")
    a, b = (json.loads((runs[m] / "metrics.json").read_text()) for m in ("all", "sequential"))
    assert a["evaluation"]["pruned"] == pytest.approx(b["evaluation"]["pruned"], rel=1e-9)
    assert a["evaluation"]["base"] == b["evaluation"]["base"]
    assert (a["params_after"], a["model_layout"]) == (b["params_after"], b["model_layout"])
    assert "layer_by_layer" in b and "layer_by_layer" not in a
    for x, y in ((runs["all"] / "model", runs["sequential"] / "model"), (tmp_path / "dense-all", tmp_path / "dense-sequential")):
        wa, wb = weights(x), weights(y)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        assert json.loads((x / "config.json").read_text()) == json.loads((y / "config.json").read_text())
    layers = json.loads((runs["sequential"] / "model" / "config.json").read_text())["num_hidden_layers"]
    assert len(list((runs["sequential"] / "model").glob("model-*.safetensors"))) == layers + 1  # a shard per block


def test_a_corrupt_or_truncated_shard_is_named_before_any_work(tmp_path, capsys):
    folder = tmp_path / "llama"
    shutil.copytree(assets.resolve("llama-shakespeare"), folder)
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* runs past the end of the file .* truncated"):
        check_shards(folder)
    shard.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        check_shards(folder)
    for onload in ("sequential", "auto", "all"):  # whichever way the model is read, the file is named first
        (tmp_path / "r.yaml").write_text(f"model: {{path: {folder}}}\nsinks: {{mode: first}}\n"
                                         f"capture: {{onload: {onload}}}\n")
        assert main(["prune", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "out")] + QUICK) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.safetensors: not a readable safetensors file" in err[0], onload
        assert not (tmp_path / "out").exists()
    header = b'{"w": 1}'  # a header that parses, but is no table of tensors
    shard.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file \(the header is not a table"):
        check_shards(folder)


def test_what_needs_the_whole_model_says_so(tmp_path, capsys):
    assert main(["prune", str(ROOT / "recipes" / "quickstart.yaml"), "--out", str(tmp_path / "g"),
                 "--set", "capture.onload=sequential", "--set", "scorer.name=ablation"] + QUICK) == 2
    assert "single-head ablations need the whole model at once: capture.onload: all" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2", "gpt_neox", "bert-mlm"])
def test_the_gradient_pass_block_by_block_equals_the_whole_models(family, side):
    """Michel et al.'s per-example |dL/d xi| backpropagated a block at a time from stored block inputs: the whole
    model's one-example-at-a-time backward, in float64 (both keep the masks in float32), and no weight left with
    a gradient or a changed flag."""
    from pruner.pruning.calibrate import gradient_importance, mlm_loss, mlm_masks
    from pruner.pruning.layerwise import gradient_layerwise

    tok = None
    if family == "bert-mlm":
        import transformers as tf
        from tiny import VOCAB
        torch.manual_seed(0)
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                                                 intermediate_size=64, vocab_size=VOCAB, pad_token_id=0)).eval()

        class Tok:  # what mask_tokens reads
            mask_token_id, all_special_ids = 3, [0, 1, 2, 3]

            def __len__(self):
                return VOCAB
        tok = Tok()
    else:
        model = tiny_model(family)
        if family in ("qwen2", "gpt_neox"):
            model.requires_grad_(False)  # some weights frozen by the caller: their flags must come back as they were
            model.lm_head.requires_grad_(True)
    model = model.double()
    flags = [p.requires_grad for p in model.parameters()]
    batch = pad(ragged_batch(seed=7, n=7, max_len=20), 0, side)
    if tok is None:
        want = gradient_importance(model, batch)
    else:
        masked = mlm_masks(batch, tok, 5)
        want = gradient_importance(model, batch, loss_fn=lambda m, b, i: mlm_loss(
            m, *masked[i], b.attention_mask[i:i + 1]))
    got = gradient_layerwise(model, batch, tok, Resident(model, "cpu"), batch_size=3, seed=5)
    assert got.shape == want.shape and (want > 0).all()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())


def test_the_gradient_scorer_prunes_block_by_block_from_disk(tmp_path, monkeypatch):
    """`scorer.name: gradient` with the blocks on disk: the whole-model loader never called, the same plan as the
    whole-model run (the scores agree to float32 rounding; the plan is what is compared)."""
    runs = whole_then_by_block(tmp_path, monkeypatch, "quickstart", ["--set", "scorer.name=gradient"])
    plans = {mode: json.loads((out / "plan.json").read_text()) for mode, out in runs.items()}
    assert plans["all"]["heads"] == plans["sequential"]["heads"]
    assert plans["all"]["scorer"] == "gradient"


def _rows(out: str) -> dict:
    """`pruner plan-memory`'s tables: (stage, where, part) -> the printed size."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| stage"):
            stage, where, part, value = (c.strip().strip("*") for c in line.strip("|").split("|")[:4])
            rows[(stage, where, part)] = value
    return rows


def test_plan_memory_from_a_config_alone(tmp_path, capsys):
    """`pruner plan-memory`: Llama-3.3-70B's public config, no weights, the default recipe on one GPU: the parts are
    the geometry's arithmetic, and layer by layer the host holds one layer's second moments at a time (issue 33:
    host <= 32 GiB and device <= 16 GiB at 128 x 2048 tokens, where every layer's sums once took 200 GiB)."""
    cfg = shapes.config_kwargs("llama-3.3-70b", architectures=["LlamaForCausalLM"])
    (tmp_path / "llama70").mkdir()
    (tmp_path / "llama70" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "r.yaml").write_text(f"model: {{path: {tmp_path / 'llama70'}, dtype: bfloat16, device: cuda}}\n"
                                     "calibration: {length: 2048, num_samples: 128, batch_size: 4}\n"
                                     "selection: {target: 0.5}\n")  # 32 of 64 heads: a servable Llama shape
    assert main(["plan-memory", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)

    def gib(text):
        return float(text.split()[0]) * (1 if text.split()[1] == "GiB" else 1 / 1024)

    square = 8192 ** 2 * 8 / 2**30  # one (H d_head)^2 float64 matrix
    block = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) * 2 / 2**30
    through, finished = "calibration: a batch through a block", "calibration: a finished layer's curves"
    assert gib(rows[(through, "device", "one block")]) == pytest.approx(block, abs=0.05)
    # ridge auto with 4 folds and the per-layer (servable) budget's refit as each layer finishes: 4 folds + the
    # joint moment of one layer; the folds accumulate in place, the joint is derived when the layer is complete
    assert 5 * square <= gib(rows[(finished, "host", "a finished layer's whole sums")]) < 5.05 * square
    assert gib(rows[(through, "device", "the layer's running sums")]) == pytest.approx(4 * square, abs=0.05)
    assert gib(rows[(finished, "host", "what is kept of the finished layers (first moments, pairs, curves)")]) < 0.05
    hidden = (128 + 4) * 2048 * 8192 * 2 / 2**30
    assert gib(rows[(through, "host", "hidden states of every window")]) == pytest.approx(hidden, abs=0.05)
    line = next(x for x in out.splitlines() if x.startswith("capture.onload: sequential"))
    device, host = (float(x.split()[0]) for x in line.split("device peak ")[1].split(", host peak "))
    assert device <= 16 and host <= 32, line
    assert ("calibration", "device", "weights") in rows and gib(rows[("calibration", "device", "weights")]) == \
        pytest.approx(131.4, abs=0.1)
    # the gradient scorer: its backward a block at a time keeps every block's input of every window on the host
    assert main(["plan-memory", str(tmp_path / "r.yaml"), "--set", "scorer.name=gradient"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert gib(rows[("gradient pass", "host", "every block's inputs (gradient pass)")]) == \
        pytest.approx(81 * 128 * 2048 * 8192 * 2 / 2**30, abs=0.1)
    # mean compensation and the sink-aware scorer: the joint moment only (the scorer reads it), no folds, no refit
    assert main(["plan-memory", str(tmp_path / "r.yaml"), "--set", "scorer.name=sink-aware",
                 "--set", "surgery.compensation=mean"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert 1 * square <= gib(rows[(finished, "host", "a finished layer's whole sums")]) < 1.05 * square
    assert not any("refit's new" in part for _, _, part in rows)
    # auto: the pass reads what any candidate reads (the refit-aware systems, the gradient pass), and a refit
    # among the compensations tried is planned as the pass of its own that it would take
    assert main(["plan-memory", str(tmp_path / "r.yaml"), "--set", "scorer.name=auto",
                 "--set", "surgery.compensation=auto"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert ("gradient pass", "host", "every block's inputs (gradient pass)") in rows
    assert any(stage.startswith("compensation pass") for stage, _, _ in rows)


@pytest.mark.parametrize("onload", ["all", "sequential"])
def test_float32_moments_keep_the_plan_and_the_refit(onload, tmp_path):
    """`capture.moments: float32` stores each layer's joint second moment in half the memory (accumulated in
    float64 either way): the same plan, and refitted weights equal to float32 precision."""
    from safetensors.torch import load_file

    runs = {}
    for moments in ("float64", "float32"):
        out = tmp_path / moments
        assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out),
                     "--set", f"capture.onload={onload}", "--set", f"capture.moments={moments}",
                     "--set", "surgery.compensation=refit", "--set", "surgery.ridge=0.1"] + QUICK) == 0
        runs[moments] = out
    p64, p32 = (json.loads((runs[m] / "plan.json").read_text()) for m in ("float64", "float32"))
    assert p64["heads"] == p32["heads"]  # the same heads, pruned in the same order
    assert [(e["layer"], e["head"]) for e in p64["entries"]] == [(e["layer"], e["head"]) for e in p32["entries"]]
    a, b = (load_file(str(runs[m] / "compensation.safetensors")) for m in ("float64", "float32"))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4 * float(a[k].abs().max()))


def test_a_layer_by_layer_calibration_that_cannot_fit_names_the_setting_that_does(monkeypatch):
    """Before any compute: device and host against the memory model; the refusal names what would fit."""
    from pruner.runs import calibration_memory, resources

    lazy = lazy_model(assets.resolve("llama-shakespeare"))
    sizes = resources.Sizes(batch_size=4, length=128, outputs=True, folds=16, local=True)
    big = calibration_memory.memory_plan(lazy.model, sizes, 64, "sequential", "cpu", systems=True)
    small = calibration_memory.memory_plan(lazy.model, replace(sizes, folds=0), 64, "sequential", "cpu", systems=True)
    outside = next(v for k, v in big.device.parts.items() if k.startswith("weights outside the blocks"))
    free = (big.total + small.total) // 2 - outside  # room without the fold moments only
    monkeypatch.setattr(calibration_memory, "available_memory", lambda device: free)
    with pytest.raises(resources.ResourceError, match=r"not enough memory for the layer-by-layer calibration: the "
                       r"memory needs about .* more and has .* free; set .*surgery.ridge: a number such as 0.1"):
        calibration_memory.check_sequential(lazy.model, sizes, 64, "cpu", systems=True)
    assert calibration_memory.check_sequential(lazy.model, replace(sizes, folds=0), 64, "cpu", True) is not None


def test_hidden_states_in_files_give_the_same_numbers_and_leave_nothing(tmp_path):
    """capture.hidden: disk: every window's hidden states in memory-mapped files between blocks -- the capture, the
    one-pass sequential refit, the gradient pass and perplexity compute exactly what they compute in memory, the
    files exist while a pass runs and are gone after it."""
    from pruner.checkpoints import loading
    from pruner.evaluation.perplexity import BlockwisePass, sliding_windows, window_scores
    from pruner.pruning.layerwise import RefitOptions, gradient_layerwise, refit_one_pass

    name = "llama-shakespeare"
    tok = loading.load_tokenizer(name)
    batch = token_windows(tok, load_texts(TextSource("shakespeare:calibration")), 32, num_samples=10)
    windows = sliding_windows(tok, load_texts(TextSource("shakespeare:evaluation")), 32, max_windows=5)
    cfg = CaptureConfig(metrics=("cosine",), outputs=True)
    runs, seen = {}, []
    for spill in (None, tmp_path / "spill"):
        lazy = lazy_model(assets.resolve(name))
        lazy.spill = spill
        def finish(layer, sums, residual):  # a probe while the pass runs: which files exist
            seen.append(sorted(p.name for p in (spill or tmp_path).rglob("*.bin")))
            return sums
        stats = capture_layerwise(lazy.model, batch, SinkSpec("first"), tok, cfg, lazy, PassOptions(batch_size=4),
                                  LayerEnd(finish=finish))
        comp = refit_one_pass(lazy.model, {0: [1], 1: [0, 2]}, batch, SinkSpec("first"), tok, lazy,
                              RefitOptions(ridge=0.1), PassOptions(batch_size=4))
        grad = gradient_layerwise(lazy.model, batch, tok, lazy, batch_size=4)
        nll = window_scores(lazy.model, windows, 4, blocks=BlockwisePass(lazy))[0]
        runs[spill is None] = (stats, comp, grad, nll)
    (a, ca, ga, na), (b, cb, gb, nb) = runs[True], runs[False]
    assert worst_relative(a, b) == 0.0
    assert ca.weight.keys() == cb.weight.keys() and all(torch.equal(ca.weight[k], cb.weight[k]) for k in ca.weight)
    assert torch.equal(ga, gb) and torch.equal(na, nb)
    assert seen[0] == [] and seen[-1] == ["0.bin", "1.bin"]  # in memory: no file; spilled: inputs and outputs
    assert (tmp_path / "spill").is_dir() and not any((tmp_path / "spill").iterdir())  # every pass removed its own


def test_prune_with_hidden_states_on_disk_and_the_memory_check_choosing_it(tmp_path, monkeypatch):
    """`capture.hidden: disk` writes the run of `memory`; with `auto` the memory check sends them to files only
    where memory cannot hold them and files make it fit (said in a warning), and names the setting otherwise."""
    from pruner.runs import calibration_memory, resources

    quick = QUICK + ["--set", "capture.onload=sequential", "--set", "surgery.ridge=0.1"]
    recipe = str(ROOT / "recipes" / "llama-shakespeare.yaml")
    assert main(["prune", recipe, "--out", str(tmp_path / "memory"), "--set", "capture.hidden=memory"] + quick) == 0
    assert main(["prune", recipe, "--out", str(tmp_path / "disk"), "--set", "capture.hidden=disk",
                 "--set", f"capture.spill_dir={tmp_path / 'files'}"] + quick) == 0

    def read(run, f):
        return json.loads((tmp_path / run / f).read_text())

    assert read("memory", "plan.json") == read("disk", "plan.json")
    assert read("memory", "metrics.json")["evaluation"] == read("disk", "metrics.json")["evaluation"]
    assert not any((tmp_path / "files").iterdir())

    lazy = lazy_model(assets.resolve("llama-shakespeare"))
    sizes = resources.Sizes(batch_size=4, length=128, outputs=True)
    kept, spilled = (calibration_memory.memory_plan(lazy.model, sizes, 4096, "sequential", "cpu", spill=s)
                     for s in (0, 1))
    outside = next(v for k, v in kept.device.parts.items() if k.startswith("weights outside the blocks"))
    d_model = lazy.model.config.hidden_size
    assert kept.total - spilled.total == 4096 * 128 * d_model * 4  # every window's hidden states, float32
    free = (kept.total + spilled.total) // 2 - outside
    monkeypatch.setattr(calibration_memory, "available_memory", lambda device: free)
    assert calibration_memory.check_sequential(lazy.model, sizes, 4096, "cpu", hidden="auto").spill
    with pytest.raises(resources.ResourceError, match=r"set capture.hidden: disk \(every window's hidden states"):
        calibration_memory.check_sequential(lazy.model, sizes, 4096, "cpu", hidden="memory")


def test_a_spill_folder_that_cannot_be_made_is_named_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(tmp_path / "x"),
                 "--set", "capture.onload=sequential", "--set", "capture.hidden=disk",
                 "--set", f"capture.spill_dir={tmp_path / 'file' / 'sub'}"] + QUICK) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pruner: error: capture.spill_dir: cannot make the folder") and \
        "Not a directory" in err[0] and not (tmp_path / "x").exists()


def test_hidden_states_on_disk_need_a_layer_by_layer_pass(tmp_path, capsys):
    assert main(["prune", str(ROOT / "recipes" / "quickstart.yaml"), "--out", str(tmp_path / "x"),
                 "--set", "capture.onload=all", "--set", "capture.hidden=disk"]) == 2
    assert "capture.hidden: disk keeps a layer-by-layer pass's hidden states" in capsys.readouterr().err


def test_the_next_block_is_read_ahead_in_the_direction_of_travel(tmp_path, capsys):
    """While block l runs, block l + 1 (l - 1 on the way down, as the gradient pass goes) is read on a background
    thread; a read for a block that does not come next is dropped; `capture.read_ahead: false` reads none."""
    from pruner.core import arch

    lazy = lazy_model(assets.resolve("minilm-causal"))
    reads = []
    state = lazy._state
    lazy._state = lambda layer, names, ahead=False: reads.append((layer, ahead)) or state(layer, names, ahead)
    for layer in (0, 1, 2, 5, 4, 3, 0):
        block = lazy.onload(layer)
        assert all(p.device.type == "cpu" for p in block.parameters())
        for pending in lazy._ahead.values():  # deterministic: each read ahead done before the next onload
            pending.result()
        lazy.offload(layer)
    # 3 read ahead of 5 is dropped; the first step down reads 4 itself, then reads ahead downwards
    assert reads == [(0, False), (1, True), (2, True), (3, True), (5, False), (4, False), (3, True), (2, True),
                     (0, False), (1, True)]
    assert all(p.device.type == "meta" for b in arch.blocks(lazy.model) for p in b.parameters())
    lazy.read_ahead, reads[:] = False, []
    lazy.onload(2)
    assert reads == [(2, False)]
    (tmp_path / "r.yaml").write_text(f"model: {{path: {assets.resolve('minilm-causal')}}}\n")
    assert main(["plan-memory", str(tmp_path / "r.yaml"), "--set", "capture.read_ahead=false"]) == 0
    assert "read ahead" not in capsys.readouterr().out
    assert main(["plan-memory", str(tmp_path / "r.yaml")]) == 0
    assert "the next block, read ahead" in capsys.readouterr().out
