"""Running a model one block at a time (docs/design.md §8.3): the chain h_{l+1} = block_l(h_l), loops swapped.

A decoder's statistics of layer l depend only on h_l, so instead of every window through every block,
every window goes through one block before the next block is loaded: the inputs of the first block
are captured once (`first_block_calls`: the model's own embedding, position and mask code runs, and a
pre-hook on block 0 keeps what it receives and stops the pass), then each block is onloaded, run over
every call, and offloaded (`run_blocks`). Peak memory is one block, the calls' hidden states and
whatever a caller accumulates per layer -- not the depth of the model. The masks and position
embeddings the model builds are computed once: the same for every block in most families; where
layers differ (Gemma 3's sliding-window and global layers have masks and rotary tables of their own)
each block's are recorded with it (`BlockCall.layer_kwargs`).

Where the blocks come from is the caller's `Onloader`: blocks already in memory moved to the compute
device and back (`Resident`), or materialised from the checkpoint's safetensors and released
(`pruner.checkpoints.lazy`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch

from pruner.core import arch
from pruner.core.runtime import forward, forward_parameters


class _Stop(Exception):
    """Raised by the block-0 pre-hook: the pass has given block 0 its inputs; the rest is not needed."""


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_move(v, device) for v in x)
    if isinstance(x, list):
        return [_move(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


@dataclass
class BlockCall:
    """One batch's call of a block: the hidden states (B, T, d_model) and everything else the model passes
    every block (attention mask, position ids and embeddings, cache flags), kept where `storage` says."""

    hidden: torch.Tensor
    kwargs: dict
    args: tuple = ()  # what the model passes after the hidden states by position (GPT-2: cache, causal mask)
    layer_kwargs: dict = field(default_factory=dict)  # layer -> the keyword arguments it gets unlike block 0's

    def kwargs_of(self, layer: int | None) -> dict:
        """What block `layer` is called with besides the hidden states (by keyword)."""
        if layer is None or layer not in self.layer_kwargs:
            return self.kwargs
        return {**self.kwargs, **self.layer_kwargs[layer]}


class Onloader(Protocol):
    spill: str | Path | None  # a folder: keep the calls' hidden states there (`Spill`), not in memory

    def onload(self, layer: int) -> torch.nn.Module: ...
    def offload(self, layer: int) -> None: ...


class Resident:
    """Blocks that stay in memory (on the CPU, say): moved to `device` to run, and back."""

    def __init__(self, model, device: str | torch.device, spill: str | Path | None = None):
        self.blocks, self.device, self.spill = arch.blocks(model), torch.device(device), spill
        self.home = [next(b.parameters()).device for b in self.blocks]

    def onload(self, layer: int) -> torch.nn.Module:
        return self.blocks[layer].to(self.device)

    def offload(self, layer: int) -> None:
        self.blocks[layer].to(self.home[layer])


def call_block(block, hidden: torch.Tensor, call: BlockCall, device) -> torch.Tensor:
    """`block` run on `hidden` (B, T, d_model) with the rest of `call`, on `device`: its output hidden states,
    on `device` (with gradients, where the caller has them on)."""
    kwargs = call.kwargs_of(block_layer(block)) if call.layer_kwargs else call.kwargs
    out = block(hidden.to(device), *_move(call.args, device), **_move(kwargs, device))
    return out[0] if isinstance(out, tuple) else out


def block_layer(block) -> int:
    """The index of a block, read off its attention module's `layer_idx` (every adapted family has one)."""
    return next(m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int))


@torch.no_grad()
def through(block, hidden: torch.Tensor, call: BlockCall, device) -> torch.Tensor:
    """One block call: `hidden` (B, T, d_model) through `block` on `device`, back where `hidden` was."""
    return kept_on(call_block(block, hidden, call, device), hidden.device)


def kept_on(x: torch.Tensor, storage: str | torch.device) -> torch.Tensor:
    """`x` where the pass keeps hidden states: from a GPU to the host into page-locked memory (the fast
    transfer path both ways, and what the next block's copy back reads from), otherwise a plain move."""
    storage = torch.device(storage)
    if x.device.type == "cuda" and storage.type == "cpu":
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return out.copy_(x)
    return x.to(storage)


class Spill:
    """The calls' hidden states in memory-mapped files under `folder` instead of in memory (`capture.hidden:
    disk`): what a layer-by-layer pass keeps between blocks -- every window's hidden states -- is the part
    that grows with the calibration set, and a file-backed page is one the kernel can write back and drop
    under pressure, where an anonymous one would have to fit. One file per slot, each holding every call's
    (B, T, d_model) in order: block `layer`'s outputs go to slot layer + 1 (`keep_every_layer`: every block's
    inputs stay, as the gradient pass needs) or alternate between two slots (inputs and outputs). Negative
    slots are the caller's (the gradient pass hands its gradients down in one, each call's overwritten once
    used). Values are exact copies: a pass with a spill computes what it computes without one. The folder
    is removed on exit, failure included."""

    def __init__(self, folder: str | Path, keep_every_layer: bool = False):
        import tempfile

        Path(folder).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="pruner-hidden-", dir=folder))
        self.keep = keep_every_layer
        self.files: dict[int, torch.Tensor] = {}  # slot -> flat file-backed tensor
        self.layout: list[tuple[int, torch.Size]] = []  # each call's offset and shape
        self.size, self.dtype = 0, None

    def __enter__(self) -> "Spill":
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        self.files.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def slot(self, layer: int) -> int:
        """Where block `layer`'s outputs go."""
        return layer + 1 if self.keep else (layer + 1) % 2

    def hold(self, calls: list[BlockCall]) -> None:
        """Block 0's inputs moved into slot 0 (the layout fixed by their shapes)."""
        self.layout, self.size = [], 0
        for call in calls:
            self.layout.append((self.size, call.hidden.shape))
            self.size += call.hidden.numel()
        self.dtype = calls[0].hidden.dtype if calls else torch.float32
        for i, call in enumerate(calls):
            call.hidden = self.put(0, i, call.hidden)

    def put(self, slot: int, i: int, x: torch.Tensor) -> torch.Tensor:
        """`x` (call i's shape) written to `slot`; returns the file-backed view of it."""
        if slot not in self.files:
            self.files[slot] = torch.from_file(str(self.root / f"{slot}.bin"), shared=True, size=max(self.size, 1),
                                               dtype=self.dtype)
        offset, shape = self.layout[i]
        view = self.files[slot][offset:offset + shape.numel()].view(shape)
        view.copy_(x)
        return view


def file_backed(x: torch.Tensor, folder: str | Path | None = None) -> torch.Tensor:
    """A copy of `x` in a memory-mapped file under `folder` (default: the system's temporary folder), unlinked at once:
    page cache the kernel writes back and drops under pressure, not anonymous memory; its disk space is freed
    when the tensor is. What a layer-by-layer run keeps of every layer that is as large as a weight (a refit's new
    output-projection columns) goes here, so that host memory does not grow with depth. Refused in one line where
    the folder's disk has no room (a mapping beyond a full disk would fault on write)."""
    import os
    import shutil
    import tempfile

    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    need = x.numel() * x.element_size()
    if need > shutil.disk_usage(folder).free:
        raise OSError(f"not enough disk space in {folder} for a layer's compensation ({need:,} bytes): free some, or "
                      "set capture.spill_dir to a folder with room")
    fd, name = tempfile.mkstemp(prefix="pruner-kept-", suffix=".bin", dir=folder)
    os.close(fd)
    try:
        out = torch.from_file(name, shared=True, size=max(x.numel(), 1), dtype=x.dtype)[:x.numel()].view(x.shape)
        out.copy_(x)
    finally:
        os.unlink(name)  # the mapping stays valid; the space is freed with it
    return out


@contextmanager
def spilled(onloader: Onloader | None, keep_every_layer: bool = False) -> Iterator[Spill | None]:
    """A `Spill` under `onloader.spill` for one pass, or None where the hidden states stay in memory."""
    folder = getattr(onloader, "spill", None)
    if folder is None:
        yield None
        return
    with Spill(folder, keep_every_layer) as spill:
        yield spill


@torch.no_grad()
def first_block_calls(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device,
                      storage: str | torch.device = "cpu", cache=None) -> list[BlockCall]:
    """What block 0 receives for each (input_ids, attention_mask) batch, by running the model's body up to it.

    Only the modules before the first block (embeddings, rotary tables, mask construction) need to be
    materialised on `device`. The calls are kept on `storage`. With a KV `cache` (one batch), the batch
    continues what the cache holds (its mask covers the cached tokens too) and every block the calls then
    run through appends its keys and values to the cache: decoding, a block at a time.
    """
    calls: list[BlockCall] = []
    with _recording(model, calls, storage):
        for ids, mask in batches:
            try:
                if cache is None:
                    forward(model.base_model, ids.to(device), mask.to(device), use_cache=False)
                else:  # positions follow the cache's length
                    name = "cache" if "cache" in forward_parameters(type(model.base_model)) else "past_key_values"
                    model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True,
                                     **{name: cache})
            except _Stop:
                pass
    return calls


class _Recorder(torch.nn.Module):
    """Stands in for block `layer` while the model's body builds the blocks' inputs: block 0's records the hidden
    states and what comes with them; every later one records what it gets unlike block 0 (the same object is the
    same: a mask or rotary table that every layer shares is kept once) and passes the hidden states on; the last
    one stops the pass. No block runs, so none needs to be in memory."""

    def __init__(self, layer: int, last: bool, calls: list[BlockCall], storage, first_kwargs: list[dict]):
        super().__init__()
        self.layer, self.last, self.calls, self.storage = layer, last, calls, storage
        self.first_kwargs = first_kwargs  # [block 0's keyword arguments in this pass], shared by the recorders

    def forward(self, hidden_states, *args, **kwargs):
        if self.layer == 0:
            self.calls.append(BlockCall(kept_on(hidden_states, self.storage), _move(kwargs, self.storage),
                                        _move(args, self.storage)))
            self.first_kwargs[:] = [kwargs]
        else:
            first = self.first_kwargs[0]
            differ = {k: v for k, v in kwargs.items() if k not in first or first[k] is not v}
            if differ:
                self.calls[-1].layer_kwargs[self.layer] = _move(differ, self.storage)
        if self.last:
            raise _Stop
        return hidden_states


@contextmanager
def _recording(model, calls: list[BlockCall], storage) -> Iterator[None]:
    """The model's blocks swapped for `_Recorder`s for the length of the block; the blocks put back after."""
    layers = arch.get(model.base_model, arch.layers_path(model))
    kept, first_kwargs = list(layers), []
    try:
        for i in range(len(kept)):
            layers[i] = _Recorder(i, i == len(kept) - 1, calls, storage, first_kwargs)
        yield
    finally:
        for i, b in enumerate(kept):
            layers[i] = b


@dataclass(frozen=True)
class PassOptions:
    """How a layer-by-layer pass runs its windows through the blocks."""

    device: str | torch.device = "cpu"   # where each onloaded block computes
    batch_size: int = 8                  # calibration windows per forward
    progress: bool = False               # a progress bar, one step per layer
    storage: str | torch.device = "cpu"  # where every window's hidden states wait between blocks


@dataclass(frozen=True)
class BlockHooks:
    """What `run_blocks` calls around each block; every hook optional.

    `before_call(layer, i)` runs before call i of a layer (a capture sets which batch the attention sees);
    `after_layer(layer)` after the layer's last call, before it is offloaded. `rerun(layer)`, after that:
    a context (a scoped mask, say) to run the layer's calls again in, from the same inputs, so that the
    next block sees the changed block's outputs -- or None to keep the first outputs. `within(layer)`: a
    context the layer's calls run in (a scoped mask of its pruned heads: the pruned model, a block at a
    time).
    """

    before_call: Callable[[int, int], None] | None = None
    after_layer: Callable[[int], None] | None = None
    rerun: Callable[[int], AbstractContextManager | None] | None = None
    within: Callable[[int], AbstractContextManager] | None = None


@torch.no_grad()
def run_blocks(onloader: Onloader, calls: list[BlockCall], n_layers: int, device, hooks: BlockHooks = BlockHooks(),
               progress=None, spill: Spill | None = None) -> list[BlockCall]:
    """Every call through block 0, then block 1, ...: each block onloaded once, offloaded after its last call.

    `hooks` run before each call, after each layer, and around a layer's calls (`BlockHooks`). With `spill`
    the hidden states live in its files (block 0's inputs moved there first). Returns the calls with the last
    block's output as their hidden states.
    """
    before_call, after_layer, rerun, within = hooks.before_call, hooks.after_layer, hooks.rerun, hooks.within
    if spill is not None:
        spill.hold(calls)
    for layer in range(n_layers):
        block = onloader.onload(layer)
        inputs = [call.hidden for call in calls] if rerun is not None else None  # kept for a rerun
        with within(layer) if within is not None else nullcontext():
            for i, call in enumerate(calls):
                if before_call is not None:
                    before_call(layer, i)
                call.hidden = _kept(spill, layer, i, through(block, call.hidden, call, device))
        if after_layer is not None:
            after_layer(layer)
        scope = rerun(layer) if rerun is not None else None
        if scope is not None:
            with scope:
                for i, (call, x) in enumerate(zip(calls, inputs)):
                    call.hidden = _kept(spill, layer, i, through(block, x, call, device))
        del inputs
        onloader.offload(layer)
        if progress is not None:
            progress.update(1)
    return calls


def _kept(spill: Spill | None, layer: int, i: int, out: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s output for call i, where the pass keeps it: in memory, or in the spill's slot."""
    return out if spill is None else spill.put(spill.slot(layer), i, out)


class _Replay(torch.nn.Module):
    """Stands in for a block: the first returns the hidden states it is given to replay, the others pass
    their input on."""

    def __init__(self, first: bool):
        super().__init__()
        self.first, self.hidden = first, None

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden.to(hidden_states.device) if self.first else hidden_states


@contextmanager
def replayed(model) -> Iterator[_Replay]:
    """The model with its blocks swapped for replays: `replay.hidden = h` (B, T, d_model), the last block's
    output, and a forward runs the model's own code after the blocks (final norm, LM head, pooling) on it.
    What a layer-by-layer pass needs to finish, with no block resident; the blocks are put back after."""
    layers = arch.get(model.base_model, arch.layers_path(model))
    kept = list(layers)
    replays = [_Replay(i == 0) for i in range(len(kept))]
    try:
        for i, r in enumerate(replays):
            layers[i] = r
        yield replays[0]
    finally:
        for i, b in enumerate(kept):
            layers[i] = b


@contextmanager
def blockwise(model, onloader: Onloader, batches: list[tuple[torch.Tensor, torch.Tensor]], device,
              within: Callable[[int], AbstractContextManager] | None = None, progress=None
              ) -> Iterator[tuple[list[BlockCall], _Replay]]:
    """A whole-model forward of every (input_ids, attention_mask) batch, a block at a time: every batch through
    block 0, then block 1, ... (each under `within(layer)`; `progress` closed after the last block), then the
    model with its blocks replayed. Yields (the calls, the replay): `replay.hidden = call.hidden` and a forward
    runs the model's own code after the blocks on that batch's last hidden states."""
    calls = first_block_calls(model, batches, device)
    with spilled(onloader) as spill:
        run_blocks(onloader, calls, len(arch.blocks(model)), device, BlockHooks(within=within), progress=progress,
                   spill=spill)
        if progress is not None:
            progress.close()
        with replayed(model) as replay:
            yield calls, replay
