"""Two processes (torchrun, gloo on CPU) recover a shipped model to one process's weights, to float tolerance:
each process backpropagates its half of every batch's KL sum over the whole batch's tokens and the gradients are
summed, so only the float summation order differs. The same with the student sharded (`recovery.fsdp`: torch's
FSDP2), and a sharded recovery killed and resumed ends with the uninterrupted one's weights bit for bit."""

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
    for (k1, v1), (k2, v2) in zip(one["history"], two["history"]):
        assert k1 == k2 and abs(v1 - v2) < 1e-5
    assert one["history"][-1][1] < one["history"][0][1]  # training happened: the validation KL fell


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp"])
def test_two_processes_recover_to_the_weights_of_one(one, tmp_path, sharded):
    launch([PROBE, str(tmp_path / "two.pt"), *(["--fsdp"] if sharded else [])], 2)
    _same_as_one(one, torch.load(tmp_path / "two.pt"))


def test_a_sharded_recovery_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path):
    ck = ["--fsdp", "--checkpoints", str(tmp_path / "ck")]
    launch([PROBE, str(tmp_path / "killed.pt"), *ck], 2, env={KILL_ENV: "recovery:4@1"}, ok=False)  # one rank dies
    assert not (tmp_path / "killed.pt").exists()
    launch([PROBE, str(tmp_path / "resumed.pt"), *ck], 2)
    launch([PROBE, str(tmp_path / "whole.pt"), "--fsdp"], 2)
    resumed, whole = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "whole.pt")
    assert resumed["steps_run"] == whole["steps_run"] - 4  # it went on from the checkpoint at step 4
    assert resumed["history"] == whole["history"]
    for key, a in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], a), key
