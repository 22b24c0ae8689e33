"""What pruning buys (pruner.evaluation.bench): exact figures equal their analytic ideal; timing is only run, never asserted."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from pruner.evaluation import bench, ideal, timing
from pruner.pruning import surgery
from pruner.pruning.selection import SelectionConfig, SelectionError

QUICK = timing.BenchConfig(lengths=(12,), decode=((2, 10),), new_tokens=3, repeats=1)


@pytest.mark.unit
def test_shape_math_by_hand():
    """Two layers, d_model 8, d_head 2: every cost function against numbers worked out on paper."""
    s = ideal.Shape(q_heads=(4, 4), kv_heads=(2, 2), d_model=8, d_head=2, q_head_params=16, o_head_params=16,
                    kv_head_params=32, other_weights=(100, 100), logits_width=80, params=1000, read_params=900,
                    itemsize=2, causal=True)
    assert s.attention_params() == 2 * (4 * 32 + 2 * 32)
    assert ideal.kv_bytes_per_token(s) == 2 * (2 * 2 * 2 * 2)  # layers x (k, v) x kv heads x d_head x bytes
    # T=3: 2*3*(8*2*(8+4) + 100) per layer weights, 4*2*4*6 attention (6 causal pairs), one LM-head row
    assert ideal.prefill_flops(s, 3) == 2 * (2 * 3 * (16 * 12 + 100) + 4 * 2 * 4 * 6) + 2 * 80
    assert ideal.decode_bytes(s, batch=2, context=5) == 900 * 2 + 2 * 5 * 32
    t = s.with_heads((2, 4), (1, 2))
    removed = 2 * 32 + 1 * 32
    assert (t.params, t.read_params) == (1000 - removed, 900 - removed)
    assert ideal.resident_bytes(t, 10) == (1000 - removed) * 2 + 10 * 24


@pytest.mark.unit
def test_config_rejects_what_cannot_run():
    with pytest.raises(ValueError, match="new_tokens"):
        timing.BenchConfig(new_tokens=1)
    with pytest.raises(ValueError, match="nothing to time"):
        timing.BenchConfig(lengths=(), decode=())
    with pytest.raises(ValueError, match=">= 1"):
        timing.BenchConfig(decode=((0, 8),))


PLANS = [("layer", "equal", 0.5), ("layer", "group", 0.5), ("global", "equal", 0.25),
         ("global", "group", 0.25), ("global", "group", 0.5)]


@pytest.mark.integration
@pytest.mark.parametrize("budget,gqa,target", PLANS)
def test_parameter_and_kv_savings_equal_the_ideal(budget, gqa, target):
    """GQA Llama (4 query / 2 KV heads): equal budgets and global ones, equal heads per group or whole groups."""
    base = tiny_model("llama")
    plan = bench.weight_plan(base, SelectionConfig(target=target, budget=budget, gqa=gqa), seed=3)
    pruned = bench.compact_copy(base, plan.heads)
    res = bench.bench(base, pruned, QUICK)
    params, kv = res.figure("parameters"), res.figure("KV cache")
    assert params.pruned < params.base and params.saving == params.ideal
    shape = ideal.shape_of(base, surgery.kept_heads(pruned))
    assert params.pruned == shape.params
    assert kv.pruned == ideal.kv_bytes_per_token(shape) and kv.saving == kv.ideal
    assert (kv.saving > 0) == (gqa == "group")  # equal heads per group keep every KV head
    assert res.heads["pruned"] == len(plan.entries)


@pytest.mark.integration
@pytest.mark.parametrize("family,heads,left", [("gpt2", {0: [0, 2, 3], 1: [1]}, [1, 3]),
                                               ("gpt_neox", {0: [1]}, [3, 4]),
                                               ("qwen2", {0: [0, 3], 1: [2, 3]}, [2, 2])])
def test_unequal_layers_other_families(family, heads, left):
    """Different head counts per layer and biases in the q/k/v projections (GPT-2, GPT-NeoX, Qwen2 with GQA)."""
    base = tiny_model(family)
    res = bench.bench(base, bench.compact_copy(base, heads), QUICK)
    params, kv = res.figure("parameters"), res.figure("KV cache")
    assert params.saving == params.ideal > 0 and kv.saving == kv.ideal > 0
    assert res.heads["per_layer"] == left


@pytest.mark.integration
def test_encoder_has_prefill_and_exact_parameters_but_no_decode():
    base = tiny_model("bert")
    res = bench.bench(base, bench.compact_copy(base, {1: [0, 1]}), QUICK)
    names = [f.name for f in res.figures]
    assert "KV cache" not in names and not any(n.startswith("decode") for n in names)
    assert "prefill T=12" in names and res.figure("parameters").saving == res.figure("parameters").ideal


@pytest.mark.integration
def test_compact_copy_shares_weights_and_leaves_the_base_alone():
    base = tiny_model("llama")
    ids = torch.arange(3, 20)[None]
    before = base(ids).logits
    heads = {0: [0, 1], 1: [1, 3]}
    pruned = bench.compact_copy(base, heads)
    assert torch.equal(base(ids).logits, before)
    assert base.model.layers[0].mlp.up_proj.weight is pruned.model.layers[0].mlp.up_proj.weight
    assert pruned.model.layers[0].self_attn.q_proj.weight.shape[0] == 2 * 8
    with surgery.masked(base, heads):
        masked = base(ids).logits
    assert torch.allclose(pruned(ids).logits, masked, atol=1e-5)


@pytest.mark.integration
def test_positions_cap_lengths_and_prompts():
    """GPT-2's 128-position table: a 512-token prefill becomes 128; a decode prompt leaves room for the new tokens."""
    base = tiny_model("gpt2")
    res = bench.bench(base, bench.compact_copy(base, {0: [1]}),
                      timing.BenchConfig(lengths=(512,), decode=((1, 500),), new_tokens=4, repeats=1))
    names = [f.name for f in res.figures]
    assert "prefill T=128" in names and "decode batch 1, prompt 123" in names
    assert res.conditions["lengths"] == [128] and res.conditions["decode"] == [[1, 123]]
    d = res.to_dict()
    assert {f["name"] for f in d["figures"]} == set(names) and "| figure |" in res.table()


@pytest.mark.integration
def test_weight_plan_respects_gqa_units():
    base = tiny_model("llama")  # 2 layers x 4 heads, 2 KV groups of 2
    with pytest.raises(SelectionError):  # one head per layer cannot hold a 2-head unit
        bench.weight_plan(base, SelectionConfig(target=0.25, budget="layer", gqa="equal"))
    plan = bench.weight_plan(base, SelectionConfig(target=0.5, budget="layer", gqa="group"))
    assert all(len(hs) == 2 and hs[0] // 2 == hs[1] // 2 for hs in plan.heads.values())


@pytest.mark.unit
def test_recipe_bench_section():
    from pruner.runs.recipe import RecipeError
    from pruner.runs.recipe_io import load_recipe

    r = load_recipe({"model": {"path": "x"}}, ["bench.decode=[[2, 30]]", "bench.repeats=5"])
    assert bench.config_of(r.bench) == timing.BenchConfig(lengths=(128, 512), decode=((2, 30),), new_tokens=32,
                                                         repeats=5)
    with pytest.raises(RecipeError, match="bench.decode"):
        load_recipe({"model": {"path": "x"}, "bench": {"decode": [[1, 8, 3]]}})
    with pytest.raises(RecipeError, match="bench: lengths, batch sizes"):
        load_recipe({"model": {"path": "x"}, "bench": {"lengths": [0]}})


@pytest.mark.integration
def test_result_round_trips_through_its_dict():
    base = tiny_model("gpt2")
    res = bench.bench(base, bench.compact_copy(base, {1: [0]}), QUICK)
    again = bench.BenchResult.from_dict(res.to_dict())
    assert again == res and again.table() == res.table()
    assert "parameters:" in res.summary() and "| figure |" in res.markdown()


@pytest.mark.integration
def test_checkpoint_bytes_are_the_weights_file_save_pretrained_writes(tmp_path):
    base = tiny_model("gpt2")  # LM head tied to the token embeddings
    base.save_pretrained(tmp_path)
    assert bench.checkpoint_bytes(base) == (tmp_path / "model.safetensors").stat().st_size
    full, half = bench.checkpoint_bytes(base), bench.checkpoint_bytes(base, torch.float16)
    weights = sum(p.numel() for p in base.parameters())  # the tied matrix counted once
    header_full, header_half = full - 4 * weights, half - 2 * weights  # JSON headers: names, shapes, offsets
    assert 0 < header_half <= header_full < header_half + 64  # offsets take fewer digits, nothing else differs
    pruned = bench.compact_copy(base, {0: [1], 1: [3]})  # 3 heads of 8 channels in a 32-wide GPT-2: no config says so
    per_head = 3 * 8 * (32 + 1) + 8 * 32  # q, k, v columns (+ biases) and output rows of one head
    assert abs(full - bench.checkpoint_bytes(pruned) - 4 * 2 * per_head) < 64  # headers differ in a few digits


@pytest.mark.integration
def test_bench_command_measures_a_run(tmp_path, capsys):
    """`pruner bench RUN_DIR` on a global-budget GQA plan: the run's own heads, exact figures, files written."""
    import json
    from pathlib import Path

    from pruner.cli import main

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    assert main(["prune", str(root / "recipes" / "llama-shakespeare.yaml"), "--out", str(run),
                 "--set", "calibration.num_samples=4", "--set", "evaluation.num_samples=2",
                 "--set", "evaluation.bootstrap=10", "--set", "evaluation.latency=false",
                 "--set", "selection.gqa=group", "--set", "selection.budget=global", "--set", "selection.shape=any",
                 "--set", "bench.enabled=false"]) == 0
    assert "bench" not in json.loads((run / "metrics.json").read_text())
    capsys.readouterr()
    assert main(["bench", str(run), "--lengths", "24", "--decode", "2x16", "--new-tokens", "3",
                 "--repeats", "1"]) == 0
    d = json.loads((run / "bench.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    assert d["heads"]["pruned"] == plan["pruned"] and d["heads"]["kv_removed"] > 0
    figures = {f["name"]: f for f in d["figures"]}
    assert figures["KV cache"]["saving"] == figures["KV cache"]["ideal"] > 0
    assert figures["checkpoint"]["unit"] == "MB, float16"  # the shipped checkpoint's own dtype
    assert "| figure |" in (run / "bench.md").read_text() and "wrote" in capsys.readouterr().out
    assert main(["bench", str(run), "--decode", "8by2"]) == 2
    assert "BATCHxPROMPT" in capsys.readouterr().err


@pytest.mark.unit
def test_llama_cpp_kv_bytes_sum_every_cache_it_reports():
    """Gemma 3's sliding-window layers get a KV cache of their own beside the global layers' (llama.cpp's iSWA): the
    bytes per token are both caches', not the first's (3 of 18 layers)."""
    from pathlib import Path

    from pruner.evaluation.llamacpp_timing import kv_per_token

    line = ("llama_kv_cache: size = {:7.2f} MiB (  2048 cells, {:3d} layers,  1/1 seqs), "
            "K (f16): {:7.2f} MiB, V (f16): {:7.2f} MiB\n")
    iswa = ("llama_kv_cache_iswa: creating non-SWA KV cache, size = 2048 cells\n" + line.format(6, 3, 3, 3)
            + "llama_kv_cache_iswa: creating     SWA KV cache, size = 2048 cells\n" + line.format(30, 15, 15, 15))
    assert kv_per_token(iswa, Path("gemma.gguf")) == 18 * 2 * 256 * 2  # 18 layers x K and V x 256 x f16
    assert kv_per_token(line.format(6, 3, 3, 3), Path("one.gguf")) == 3 * 2 * 256 * 2
    with pytest.raises(RuntimeError, match="did not report its KV cache"):
        kv_per_token("no cache here", Path("x.gguf"))
