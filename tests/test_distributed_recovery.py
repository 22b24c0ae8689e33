"""Two processes (torchrun, gloo on CPU) recover a shipped model to one process's weights, to float tolerance:
each process backpropagates its half of every batch's KL sum over the whole batch's tokens and the gradients are
summed, so only the float summation order differs."""

from __future__ import annotations

import pytest
import torch

from tests.test_distributed import HERE, launch

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("torchrun")]  # one process group at a time


def test_two_processes_recover_to_the_weights_of_one(tmp_path):
    from tests import recovery_probe

    recovery_probe.main(str(tmp_path / "one.pt"))  # one process: this one (no interpreter to start)
    launch([str(HERE / "recovery_probe.py"), str(tmp_path / "two.pt")], 2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    assert one["weights"].keys() == two["weights"].keys()
    moved = 0
    for key, a in one["weights"].items():
        torch.testing.assert_close(two["weights"][key], a, rtol=1e-4, atol=1e-5, msg=key)
    for (k1, v1), (k2, v2) in zip(one["history"], two["history"]):
        assert k1 == k2 and abs(v1 - v2) < 1e-5
    moved = one["history"][-1][1] < one["history"][0][1]
    assert moved  # training happened: the validation KL fell
