"""Recover a pruned shipped Llama in this process (or in each of several under torchrun) and save the weights.

    python tests/recovery_probe.py OUT.pt
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/recovery_probe.py OUT.pt [--fsdp]
        [--checkpoints DIR] [--method full|lora|attention] [--dense]

tests/test_distributed_recovery.py compares the two (docs/recovery.md: several processes)."""

from __future__ import annotations

import copy
import sys

import torch

import pruner
from pruner.checkpoints import loading
from pruner.core import assets, distributed
from pruner.pruning import surgery


def main(out: str, fsdp: bool = False, checkpoints: str | None = None, method: str = "full", dense: bool = False
         ) -> None:
    torch.set_num_threads(1)
    teacher = loading.load_model("llama-shakespeare")
    tokenizer = loading.load_tokenizer("llama-shakespeare")
    student = copy.deepcopy(teacher)
    heads = {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}  # 2 of 4 per KV group
    surgery.mask_heads(student, heads) if dense else surgery.remove_heads(student, heads)
    play = sorted(assets.shakespeare("calibration").glob("*.txt"))[0]  # read directly: no `datasets` start-up
    texts = [play.read_text()[:60000]]
    done = pruner.recover(student, teacher, tokenizer, texts, tokens=2048, batch_size=4, length=64,
                          eval_every=512, save_every=512, fsdp=fsdp, method=method, checkpoint_dir=checkpoints, progress=False)
    if distributed.is_main():
        torch.save({"world": distributed.world_size(), "weights": done.model.state_dict(),
                    "history": done.record["validation_history"],
                    "steps_run": done.record["steps_run"]}, out)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], fsdp="--fsdp" in args, checkpoints=args[args.index("--checkpoints") + 1] if "--checkpoints" in args
         else None, method=args[args.index("--method") + 1] if "--method" in args else "full", dense="--dense" in args)
