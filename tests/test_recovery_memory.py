"""Recovery's memory: what each method trains counted as PEFT and AdamW see it, the default method decided by the
free memory, a method that does not fit refused before any text is sampled, and a cached teacher's weights freed
while the student trains (docs/recovery.md "Memory")."""

from __future__ import annotations

import copy

import pytest
import torch

import pruner
from pruner.core import resume
from pruner.core.runtime import model_bytes
from pruner.recovery import memory, methods
from pruner.recovery.data import RecoveryError
from pruner.recovery.spec import RecoverySpec
from pruner.runs import recovery_memory, recovery_stage
from pruner.runs.resources import ResourceError
from tests.test_recovery import QUICK, Killed, pair, texts


@pytest.mark.unit
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
@pytest.mark.parametrize("method", ["full", "blocks", "lora", "attention"])
def test_the_trained_weights_are_the_ones_the_optimizer_gets(family, method):
    _, student, _ = pair(family)
    counted = sum(memory.trained_tensors(student, method, rank=8))
    model = methods.prepare(copy.deepcopy(student), method, rank=8)
    assert counted == sum(p.numel() for p in methods.trainable(model).values()) > 0


def _free(monkeypatch, n: int | None) -> None:
    monkeypatch.setattr(recovery_memory, "available_memory", lambda device: n)


def _estimates(student, teacher, spec):
    held = memory.held_now(student, teacher)
    return {m: recovery_memory.estimate(student, teacher, spec, m, True).total - held
            for m in ("full", "lora")}


@pytest.mark.unit
def test_the_default_trains_every_weight_where_it_fits_and_lora_where_only_lora_does(monkeypatch):
    teacher, student, _ = pair("llama")
    spec = RecoverySpec(**QUICK)
    need = _estimates(student, teacher, spec)
    assert need["lora"] < need["full"]  # the gradients and AdamW state of every weight
    _free(monkeypatch, need["full"])
    chosen, est, note = recovery_memory.choose(student, teacher, spec, teacher_held=True)
    assert chosen.method == "full" and note is None and est.parts["trained state"] > 0
    _free(monkeypatch, need["lora"])
    chosen, est, note = recovery_memory.choose(student, teacher, spec, teacher_held=True)
    assert chosen.method == "lora" and "training LoRA adapters instead" in note
    with pytest.raises(ResourceError, match="recovery.method: lora") as e:  # chosen so: refused, with what fits
        recovery_memory.choose(student, teacher, spec.model_copy(update={"method": "full"}), teacher_held=True)
    assert len(str(e.value).splitlines()) == 1
    _free(monkeypatch, 0)
    with pytest.raises(ResourceError, match="not enough memory for recovery"):
        recovery_memory.choose(student, teacher, spec, teacher_held=True)


@pytest.mark.unit
def test_a_cached_teacher_that_is_let_go_is_not_counted_and_a_smaller_batch_is_offered(monkeypatch):
    teacher, student, _ = pair("llama")
    spec = RecoverySpec(**{**QUICK, "teacher": "cached"})
    held = recovery_memory.estimate(student, teacher, spec, "full", True)
    freed = recovery_memory.estimate(student, teacher, spec, "full", False)
    assert held.total - freed.total == model_bytes(teacher) == held.parts["teacher"]
    big = spec.model_copy(update={"batch_size": 64, "length": 256})
    loaded = memory.held_now(student, teacher)
    full = recovery_memory.estimate(student, teacher, big, "full", False).total - loaded
    _free(monkeypatch, full - 1)
    with pytest.raises(ResourceError, match=r"recovery.batch_size: (32|16|8|4|2|1) \(about"):
        recovery_memory.choose(student, teacher, big.model_copy(update={"method": "full"}), teacher_held=False)


@pytest.mark.integration
def test_recover_falls_back_to_lora_says_so_and_returns_a_plain_model(word_tokenizer, monkeypatch):
    teacher, student, _ = pair()
    spec = RecoverySpec(**QUICK)
    need = _estimates(student, teacher, spec)
    _free(monkeypatch, (need["full"] + need["lora"]) // 2)
    out = pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), progress=False, **QUICK)
    r = out.record
    assert r["method"] == "lora" and "training LoRA adapters instead" in r["note"]
    adapters = memory.trained_tensors(student, "lora")
    assert r["memory_estimate"]["trained state"] == (memory.STATE_PER_TRAINED * sum(adapters)
                                                     + memory.STEP_COPIES * 4 * max(adapters))
    assert dict(out.model.named_parameters()).keys() == dict(student.named_parameters()).keys()  # merged


@pytest.mark.integration
def test_a_cached_teacher_is_freed_while_the_student_trains_and_read_again_after(word_tokenizer, monkeypatch):
    from pruner.evaluation.perplexity import sliding_windows

    teacher, student, _ = pair()
    spec = RecoverySpec(**{**QUICK, "teacher": "cached", "top_k": 64, "method": "full"})
    ev = sliding_windows(word_tokenizer, texts(8, seed=5), 16)
    held = recovery_stage.recover_models(copy.deepcopy(student), teacher, word_tokenizer, spec,
                                         measures=recovery_stage.Measures(ev),
                                         options=recovery_stage.Options(progress=False),
                                         text=recovery_stage.RecoveryText(texts()))
    devices, real = [], recovery_stage.train

    def watching(model, targets, *args, **kwargs):
        devices.append(next(let_go.parameters()).device.type)
        return real(model, targets, *args, **kwargs)
    monkeypatch.setattr(recovery_stage, "train", watching)
    let_go = copy.deepcopy(teacher)
    freed = recovery_stage.recover_models(copy.deepcopy(student), let_go, word_tokenizer, spec,
                                          measures=recovery_stage.Measures(ev),
                                          options=recovery_stage.Options(progress=False),
                                          text=recovery_stage.RecoveryText(texts()),
                                          access=recovery_stage.TeacherAccess(reload=lambda: copy.deepcopy(teacher)))
    assert devices == ["meta"]  # no teacher weight in memory while the student trained
    assert freed.record["memory_estimate"]["teacher"] == 0 < held.record["memory_estimate"]["teacher"]
    assert freed.record["perplexity"] == held.record["perplexity"]  # the scores after: the teacher read again
    want, got = held.model.state_dict(), freed.model.state_dict()
    assert list(got) == list(want)
    for n, a in want.items():
        assert torch.equal(a, got[n]), n


@pytest.mark.integration
def test_a_resume_whose_default_method_would_change_is_refused(word_tokenizer, tmp_path, monkeypatch):
    teacher, student, _ = pair()
    opts = {**QUICK, "save_every": 128, "progress": False}

    def point(name: str) -> None:
        if name == "recovery:5":
            raise Killed(name)
    monkeypatch.setattr(resume, "kill_point", point)
    with pytest.raises(Killed):  # trained every weight: the memory was there
        pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), checkpoint_dir=tmp_path, **opts)
    need = _estimates(student, teacher, RecoverySpec(**QUICK))
    _free(monkeypatch, (need["full"] + need["lora"]) // 2)  # now only LoRA fits
    with pytest.raises(RecoveryError, match="set recovery.method: full to resume it"):
        pruner.recover(copy.deepcopy(student), teacher, word_tokenizer, texts(), checkpoint_dir=tmp_path, **opts)


@pytest.mark.unit
def test_the_cache_built_a_window_at_a_time_holds_what_the_whole_batch_gives(tmp_path):
    import numpy as np

    from pruner.core import data
    from pruner.recovery import loss
    from pruner.recovery import teacher as rteacher

    teacher, _, _ = pair("llama")
    ids = torch.randint(0, teacher.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    w = data.TokenBatch(ids, torch.ones_like(ids))
    cache = rteacher.Cached.build(teacher.eval(), w, tmp_path, rteacher.CacheSpec(k=5, tail_samples=3, seed=7),
                                  batch_size=4)
    with torch.no_grad():  # the batches the cache ran, each whole through the loss's functions
        logits = torch.cat([rteacher.forward_logits(teacher, ids[s], w.attention_mask[s])
                            for s in (slice(0, 4), slice(4, 6))])
    top, idx, tail = loss.topk_targets(logits, 5)
    sid, slp = loss.tail_samples(logits, idx, 3, torch.Generator().manual_seed(7))
    for name, want in {"top": top, "idx": idx, "tail": tail, "sid": sid, "slp": slp}.items():
        assert np.array_equal(getattr(cache, name), want.numpy()), name


@pytest.mark.integration
@pytest.mark.slow  # the GPU script end to end on a CPU: run it before borrowing a GPU (docs/tests.md)
def test_the_prepared_gpu_script_runs_its_check_on_a_cpu_and_predicts_without_weights(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def run(*a):
        return subprocess.run([sys.executable, "-m", "eval.gpu.recovery", *a], cwd=root, capture_output=True, text=True)

    same = run("--device", "cpu", "--only", "same", "--same-steps", "2", "--out", str(tmp_path / "recovery.json"))
    assert same.returncode == 0 and same.stdout.count("ok  ") == 2, same.stdout + same.stderr[-2000:]
    pred = run("--predict", "--model", "qwen2.5-0.5b")
    got = dict(re.findall(r"qwen2.5-0.5b (\w+:\w+), 8 x 128: predicted peak ([\d.]+) GiB", pred.stdout))
    gib = {k: float(v) for k, v in got.items()}
    assert len(gib) == 4 and gib["full:resident"] > gib["full:cached"] > gib["lora:cached"], pred.stdout
    assert gib["full:resident"] > gib["lora:resident"] > gib["lora:cached"]
