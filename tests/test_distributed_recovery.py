"""Two processes (torchrun, gloo on CPU) recover a shipped model to one process's weights, to float tolerance:
each process backpropagates its half of every batch's KL sum over the whole batch's tokens and the gradients are
summed, so only the float summation order differs. The same with the student sharded (`recovery.fsdp`: torch's
FSDP2), with LoRA's adapters (replicated and sharded, on a compact and on a dense student), and a sharded recovery
killed and resumed ends with the uninterrupted one's weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from pruner.core.resume import KILL_ENV
from tests.test_distributed import HERE, launch

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("torchrun")]  # one process group at a time
PROBE = str(HERE / "recovery_probe.py")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    from tests import recovery_probe

    out = tmp_path_factory.mktemp("one") / "one.pt"
    recovery_probe.main(str(out))  # one process: this one (no interpreter to start)
    return torch.load(out)


def _same_as_one(one: dict, two: dict) -> None:
    assert (one["world"], two["world"]) == (1, 2)
    assert one["weights"].keys() == two["weights"].keys()
    for key, a in one["weights"].items():
        torch.testing.assert_close(two["weights"][key], a, rtol=1e-4, atol=1e-5, msg=key)
    assert [k for k, _ in two["history"]] == [k for k, _ in one["history"]]  # the same steps, none missing
    for (_, v1), (_, v2) in zip(one["history"], two["history"]):
        assert abs(v1 - v2) < 1e-5
    assert one["history"][-1][1] < one["history"][0][1]  # training happened: the validation KL fell


@pytest.fixture(scope="module")
def two_sharded(tmp_path_factory):
    """Two processes, the student sharded, uninterrupted: the run the killed and resumed one must end as."""
    out = tmp_path_factory.mktemp("two-fsdp") / "two.pt"
    launch([PROBE, str(out), "--fsdp"], 2)
    return torch.load(out)


def test_two_processes_recover_to_the_weights_of_one(one, tmp_path):
    launch([PROBE, str(tmp_path / "two.pt")], 2)
    _same_as_one(one, torch.load(tmp_path / "two.pt"))


def test_two_sharded_processes_recover_to_the_weights_of_one(one, two_sharded):
    _same_as_one(one, two_sharded)


def test_a_sharded_recovery_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path, two_sharded):
    ck = ["--fsdp", "--checkpoints", str(tmp_path / "ck")]
    launch([PROBE, str(tmp_path / "killed.pt"), *ck], 2, env={KILL_ENV: "recovery:4@1"}, ok=False)  # one rank dies
    assert not (tmp_path / "killed.pt").exists()
    launch([PROBE, str(tmp_path / "resumed.pt"), *ck], 2)
    resumed, whole = torch.load(tmp_path / "resumed.pt"), two_sharded
    assert resumed["steps_run"] == whole["steps_run"] - 4  # it went on from the checkpoint at step 4
    assert resumed["history"] == whole["history"]
    for key, a in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], a), key


@pytest.fixture(scope="module")
def one_lora(tmp_path_factory):
    from tests import recovery_probe

    out = {}
    for dense in (False, True):
        path = tmp_path_factory.mktemp("one-lora") / "one.pt"
        recovery_probe.main(str(path), method="lora", dense=dense)
        out[dense] = torch.load(path)
    return out


@pytest.mark.parametrize("dense,sharded", [  # the default suite keeps the sharded compact case
    pytest.param(False, False, marks=pytest.mark.slow), (False, True), pytest.param(True, True, marks=pytest.mark.slow)],
                         ids=["compact-replicated", "compact-fsdp", "dense-fsdp"])
def test_lora_in_two_processes_recovers_to_the_weights_of_one(one_lora, tmp_path, dense, sharded):
    """LoRA's adapters start from the recovery's seed in every process (they used to start from whatever each
    process's random stream held, so two processes trained apart from one), and FSDP shards the frozen weights
    with them; a dense student's pruned heads stay zero (its output projection is never adapted)."""
    launch([PROBE, str(tmp_path / "two.pt"), "--method", "lora", *(["--fsdp"] if sharded else []),
            *(["--dense"] if dense else [])], 2)
    two = torch.load(tmp_path / "two.pt")
    _same_as_one(one_lora[dense], two)
    assert not any(".lora_" in k for k in two["weights"])  # merged: a plain checkpoint
    if dense:
        o = two["weights"]["model.layers.0.self_attn.o_proj.weight"]  # (d_model, heads * d_head); heads 0 and 4 pruned
        d_head = o.shape[1] // 8
        assert not o[:, :d_head].any() and not o[:, 4 * d_head:5 * d_head].any() and o[:, d_head:2 * d_head].any()
