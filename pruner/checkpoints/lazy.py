"""A model whose decoder blocks stay on disk until they run: for layer-by-layer passes over models larger than
memory (`capture.onload: sequential`).

The model is built on the meta device from its config (no weights in memory, buffers such as the rotary
tables real); everything outside the blocks -- embeddings, final norm, language-model head -- is read at
once; each block is read from the checkpoint's safetensors when `onload` asks for it (memory-mapped,
copied in the model's dtype onto the compute device) and released by `offload`. Peak memory is the
non-block weights and one block (two with `read_ahead`: the next block is read on a background thread
while the current one runs, so reading from disk, or copying to the GPU, overlaps compute), whatever the
depth. Every shard is checked whole before anything is read (`storage.check_shards`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pruner.checkpoints import loading
from pruner.checkpoints.storage import CheckpointError, check_shards
from pruner.core import arch
from pruner.core.host_memory import map_large_buffers, release_freed


def saved_names(model, names: list[str]) -> list[str]:
    """The names `save_pretrained` writes model tensors under (transformers' weight renamings reverted)."""
    from transformers.modeling_utils import revert_weight_conversion

    return [next(iter(revert_weight_conversion(model, {n: torch.empty(0, device="meta")}))) for n in names]


class LazyBlocks:
    """`pruner.core.layerwise.Onloader` over a checkpoint folder: `model` is ready to run but for its blocks."""

    def __init__(self, folder: str | Path, config, cls, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.folder, self.dtype, self.device = Path(folder), dtype, torch.device(device)
        self.config, self.cls = config, cls
        self.zero_missing_bias = False  # set by a writer that gave every block a bias the checkpoint lacks
        self.spill: Path | None = None  # a folder: passes keep their hidden states there (`layerwise.Spill`)
        self.read_ahead = True  # read the next block while one runs (one more block in memory)
        self._ahead: dict[int, object] = {}  # layer -> Future of its state
        map_large_buffers()  # block after block of large buffers: mapped on their own, never fragmenting the heap
        self._last: int | None = None
        self._pool = None
        self.where = check_shards(self.folder)
        self.model = self.skeleton(config)
        names = {id(m): n for n, m in self.model.named_modules()}
        self.prefixes = [names[id(b)] + "." for b in arch.blocks(self.model)]
        self.prefix = self.model.base_model_prefix + "."
        outside = [k for k in self.model.state_dict() if not any(k.startswith(p) for p in self.prefixes)]
        self._assign(self.model, {k: self._read(k) for k in outside if self._key(k) is not None})
        self.model.tie_weights()
        left = [n for n, p in self.model.named_parameters() if p.device.type == "meta"
                and not any(n.startswith(p) for p in self.prefixes)]
        if left:
            raise CheckpointError(f"{self.folder}: the checkpoint has no weights for {', '.join(left[:3])}")

    def skeleton(self, config=None) -> torch.nn.Module:
        """The model with no weights in memory (meta tensors; buffers such as rotary tables real), built from
        `config` (default: a copy of the checkpoint's, so surgery on the skeleton leaves this model's alone)."""
        import copy

        from accelerate import init_empty_weights

        config = copy.deepcopy(self.config) if config is None else config
        build = getattr(self.cls, "from_config", None) or self.cls._from_config  # Auto class or a concrete one
        with init_empty_weights(include_buffers=False):
            model = build(config, dtype=self.dtype, attn_implementation="sdpa").eval()
        model.tie_weights()  # as from_pretrained does: tied parameters counted once
        return model

    def _key(self, name: str) -> str | None:
        """The checkpoint's name for a model tensor (with or without the base model's prefix, or under the name
        transformers saves it by: GPT-NeoX's `lm_head` is `embed_out` on disk)."""
        for k in (name, self.prefix + name, name.removeprefix(self.prefix)):
            if k in self.where:
                return k
        saved = saved_names(self.model, [name])[0]
        return saved if saved in self.where else None

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        key = self._key(name)
        if key is None:
            raise CheckpointError(f"{self.folder}: no tensor {name} in the checkpoint")
        with safe_open(str(self.where[key]), framework="pt", device="cpu") as f:
            t = f.get_tensor(key)
        return t.to(self.dtype) if t.is_floating_point() else t

    def _assign(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        state = {k: v.to(self.device) for k, v in state.items()}
        module.load_state_dict(state, strict=False, assign=True)

    def onload(self, layer: int) -> torch.nn.Module:
        """Block `layer` with its weights on the device; with `read_ahead`, the next block in the direction of
        travel (layer + 1, or layer - 1 after a step down) starts being read while this one runs."""
        block = arch.blocks(self.model)[layer]
        ahead, self._ahead = self._ahead, {}
        state = ahead.pop(layer).result() if layer in ahead else self._state(layer, self._names(layer))
        for stale in ahead.values():  # read for a layer that did not come next: dropped
            stale.cancel()
        self._assign(block, state)
        step = -1 if self._last == layer + 1 else 1
        self._last = layer
        if self.read_ahead and 0 <= layer + step < len(self.prefixes):
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pruner-read-ahead")
            self._ahead[layer + step] = self._pool.submit(self._state, layer + step, self._names(layer + step), True)
        return block

    def _names(self, layer: int) -> list[tuple[str, torch.Size]]:
        """Block `layer`'s tensor names and shapes, read off the model here (not on the read-ahead thread)."""
        return [(k, v.shape) for k, v in arch.blocks(self.model)[layer].state_dict().items()]

    def _state(self, layer: int, names: list[tuple[str, torch.Size]], ahead: bool = False) -> dict[str, torch.Tensor]:
        """Block `layer`'s tensors in the model's dtype. `ahead` (on the read-ahead thread): made resident where
        they will run -- the memory-mapped pages read in (a CPU), or copied to the device on a side stream that
        is waited for before they are handed over (a GPU) -- while the current block computes."""
        prefix = self.prefixes[layer]
        state = {}
        for k, shape in names:
            if self._key(prefix + k) is None and self.zero_missing_bias and k.endswith("bias"):
                state[k] = torch.zeros(shape, dtype=self.dtype)  # a bias the surgery added (zero until set)
            else:
                state[k] = self._read(prefix + k)
        if not ahead:
            return state
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                state = {k: v.to(self.device, non_blocking=True) for k, v in state.items()}
            stream.synchronize()
            for v in state.values():  # freed later on the compute stream: not reused before its work is done
                v.record_stream(torch.cuda.current_stream(self.device))
        elif self.device.type == "cpu":
            for v in state.values():  # one element per page: the kernel reads the file in while this one runs
                if v.numel():
                    v.reshape(-1)[::max(1, 4096 // v.element_size())].sum()
        return state

    def offload(self, layer: int) -> None:
        arch.blocks(self.model)[layer].to("meta")
        release_freed()  # its buffers back to the system, not kept by the allocator (pruner.core.host_memory)


def lazy_model(folder: str | Path, dtype: str = "float32", device: str = "cpu") -> LazyBlocks:
    """`LazyBlocks` of a checkpoint folder, its class chosen as `pruner.load` would: transformers' Auto class for
    a vanilla checkpoint, pruner's packaged class for a per-layer one (no remote code)."""
    from transformers import AutoConfig

    from pruner.core.runtime import auto_class

    d = loading.read_config(folder)
    if loading.is_per_layer(d):
        cls = loading.per_layer_class(folder, d)
        return LazyBlocks(folder, cls.config_class.from_pretrained(folder), cls, getattr(torch, dtype), device)
    config = AutoConfig.from_pretrained(folder)
    return LazyBlocks(folder, config, auto_class(config), getattr(torch, dtype), device)
