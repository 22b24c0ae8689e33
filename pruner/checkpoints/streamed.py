"""Writing a pruned checkpoint one block at a time: `pruner prune` on a model larger than memory.

`saving.save` needs the pruned model in memory. Here the base's blocks stay in its safetensors
(`LazyBlocks`), and the same surgery functions run on one block at a time:

1. **Dry run** (`dry_run`): the surgery on a skeleton of the model (meta tensors, no memory) fixes the
   layout, the config and the parameter count before anything is written; a surgery that cannot be
   done or a layout no file can hold fails here, in one line.
2. **Write**: each block is read, pruned with its layer's compensation, written as its own shard in the
   storage dtype, run on the check tokens (in the model's dtype, and rounded to the storage dtype), and
   released; then the weights outside the blocks (tied ones once, as `save_pretrained` writes them),
   config.json, the shard index and the tokenizer.
3. **Check**, as `saving.verify` does for a model in memory, block by block: the written folder is read
   back a block at a time (pruner's own classes: no remote code) and its logits must equal the pruned
   model's, rounded to the storage dtype, within `saving.ATOL`; for a causal LM, decoding through the
   KV cache (8 tokens cached, then 8 more through the cache) must give the pruned model's logits
   (decoded the same way while it was written) within `saving.ATOL` and the same next tokens -- the
   cache is where written head counts that do not match the weights would show.

Peak memory: the weights outside the blocks (during the check, the written copy's too; both memory-mapped,
resident as read), one block (and its storage-dtype copy when the dtypes differ), the check tokens' hidden
states. The written shards are one per block plus one for the rest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pruner.checkpoints import layout as forms
from pruner.checkpoints import modeling, saving
from pruner.checkpoints.lazy import LazyBlocks, lazy_model, saved_names
from pruner.checkpoints.storage import CheckpointError, rounded_to
from pruner.core import arch, runtime
from pruner.core.layerwise import first_block_calls, replayed, through
from pruner.pruning import surgery

CACHED = 8  # tokens the KV-cache check puts in the cache before the rest go through it


@dataclass(frozen=True)
class Planned:
    """What the surgery makes of the model, from the skeleton: written before any weight is."""

    layout: str                   # dense | vanilla | per-layer
    why_per_layer: str | None
    config: object                # the config.json to write
    architecture: str             # the class config.json names
    params: int                   # parameters of the pruned model
    bias: bool                    # the surgery turns on the config's attention bias (every block gets one)
    note: str | None = None       # a vanilla checkpoint written as another family's class: why


def dry_run(lazy: LazyBlocks, heads: dict[int, list[int]], comp: surgery.Compensation, removed: bool) -> Planned:
    """The surgery on a weightless skeleton: the layout, config and size of the pruned model, or the error."""
    sk = lazy.skeleton()
    (surgery.remove_heads if removed else surgery.mask_heads)(sk, {k: v for k, v in heads.items() if v}, comp)
    kind, why = forms.layout(sk, removed)
    form = forms.vanilla_form(sk) if kind == "vanilla" else None
    if kind == "per-layer":
        config = forms.per_layer_config(sk)
        name = modeling.per_layer_class(sk.config.model_type, type(sk).__name__).__name__
    else:
        config, name = (form.config, form.architecture) if form and form.architecture else (sk.config, type(sk).__name__)
        if form and form.architecture is None:
            forms.vanilla_model(sk, form)  # the head counts into its config
    flag = arch.adapter_for(sk).bias_flag
    bias = flag is not None and bool(getattr(sk.config, flag, False)) and not getattr(lazy.model.config, flag, False)
    return Planned(kind, why, config, name, sum(p.numel() for p in sk.parameters()), bias,
                   form.note if form else None)


def shard_name(i: int, total: int) -> str:
    return f"model-{i:05d}-of-{total:05d}.safetensors"


def _finish(model, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) from the last block's output, by the model's own code after the blocks."""
    with replayed(model) as replay:
        replay.hidden = hidden
        return saving.logits(model, ids)


def _write(tensors: dict[str, torch.Tensor], path: Path, store: torch.dtype, index: dict, names=None) -> None:
    """`tensors` as one safetensors shard in `store`, under the names `names` gives them (default: their own)."""
    from safetensors.torch import save_file

    keys = names(list(tensors)) if names is not None else list(tensors)
    out = {k: (v.to("cpu", store) if v.is_floating_point() else v.cpu()).contiguous()
           for k, v in zip(keys, tensors.values())}
    save_file(out, str(path), metadata={"format": "pt"})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in out.values())
    index["weight_map"].update(dict.fromkeys(out, path.name))


class _Expected:
    """The pruned model's outputs on the check tokens, a block at a time as it is written: in its own dtype
    (`exact`), rounded to the storage dtype (`rounded`: what the files must reproduce), and for a causal LM
    decoded through a KV cache, CACHED tokens then the rest (`prefix`, `rest`)."""

    def __init__(self, model, device, store: torch.dtype, ids: torch.Tensor | None = None):
        self.model, self.device, self.store = model, device, store
        self.ids = saving.check_ids(model).to(device) if ids is None else ids  # (2, CHECK_TOKENS)
        self.mask = torch.ones_like(self.ids)
        self.exact = self._calls(self.ids, self.mask)
        self.causal = runtime.attends_causally(model)
        self.cache = _new_cache(model) if self.causal else None
        with rounded_to(model, store):
            self.rounded = self._calls(self.ids, self.mask)
            self.prefix = self._calls(self.ids[:, :CACHED], self.mask[:, :CACHED], self.cache) if self.causal else None
        self.rest = None

    def _calls(self, ids, mask, cache=None):
        return first_block_calls(self.model, [(ids, mask)], self.device, self.device, cache)[0]

    def run(self, block) -> None:
        """The check tokens through the next block (pruned, in memory)."""
        self.exact.hidden = through(block, self.exact.hidden, self.exact, self.device)
        with rounded_to(block, self.store):
            self.rounded.hidden = through(block, self.rounded.hidden, self.rounded, self.device)
            if not self.causal:
                return
            self.prefix.hidden = through(block, self.prefix.hidden, self.prefix, self.device)
            if self.rest is None:  # block 0 has cached the first tokens: the rest can be embedded after them
                with rounded_to(self.model, self.store):
                    self.rest = self._calls(self.ids[:, CACHED:], self.mask, self.cache)
            self.rest.hidden = through(block, self.rest.hidden, self.rest, self.device)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(exact, rounded, rounded decoded through the cache or None): (B, T, V), (B, T, V), (B, T - CACHED, V)."""
        got = _finish(self.model, self.ids, self.exact.hidden)
        with rounded_to(self.model, self.store):
            want = _finish(self.model, self.ids, self.rounded.hidden)
            cached = _finish(self.model, self.ids[:, CACHED:], self.rest.hidden) if self.causal else None
        return got, want, cached


@dataclass(frozen=True)
class StreamedWrite:
    """How `save_streamed` writes: storage dtype and the progress bar."""

    dtype: str | None = None  # the storage dtype ("float16", ...); None: the lazy model's own
    progress: bool = False    # a progress bar, one step per layer
    label: str = "model/"     # what the bar says is being written


def save_streamed(lazy: LazyBlocks, tokenizer, folder: Path, heads: dict[int, list[int]],
                  comp: surgery.Compensation | None, removed: bool, write: StreamedWrite = StreamedWrite()
                  ) -> saving.Saved:
    """Prune `lazy`'s model block by block into `folder` (an existing, empty folder) and prove it reloads.

    The same checkpoint `saving.save` writes for the pruned model in memory (the same tensors, config and
    layout; one shard per block). Leaves `lazy.model`'s blocks pruned (on the meta device): it is spent.
    Raises CheckpointError when no layout holds the model or the written files do not reproduce it.
    """
    from tqdm.auto import tqdm

    folder, comp = Path(folder), surgery.as_compensation(comp)
    heads = {k: v for k, v in heads.items() if v}
    planned = dry_run(lazy, heads, comp, removed)
    model = lazy.model
    if planned.bias:  # every block gets the (zero) biases the config will declare, before any is written
        surgery.enable_attention_bias(model)
        lazy.zero_missing_bias = True
    dtype, progress, label = write.dtype, write.progress, write.label
    store = getattr(torch, dtype) if dtype else lazy.dtype
    expected = _Expected(model, lazy.device, store)
    total = len(lazy.prefixes) + 1
    # the names save_pretrained would write (GPT-NeoX's lm_head is embed_out); pruner's per-layer classes rename none
    names = None if planned.layout == "per-layer" else (lambda keys: saved_names(model, keys))
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for layer in tqdm(range(total - 1), desc=f"writing {label} (layer by layer)", unit="layer", disable=not progress):
        block = lazy.onload(layer)
        if layer in heads:
            (surgery.remove_heads if removed else surgery.mask_heads)(model, {layer: heads[layer]}, comp)
        _write({lazy.prefixes[layer] + k: v for k, v in block.state_dict().items()},
               folder / shard_name(layer + 1, total), store, index, names)
        expected.run(block)
        lazy.offload(layer)
    _write_rest(lazy, planned, tokenizer, folder, store, index, names)
    got, want, cached = expected.logits()
    max_diff, generation, route = verify_streamed(folder, lazy.dtype, lazy.device, expected.ids, want, cached)
    return saving.Saved(planned.layout, planned.why_per_layer, str(store).removeprefix("torch."), max_diff,
                        (want - got).abs().max().item(), generation, (route,), planned.note)


def _write_rest(lazy: LazyBlocks, planned: Planned, tokenizer, folder: Path, store: torch.dtype, index: dict,
                names) -> None:
    """The weights outside the blocks (tied ones once, as save_pretrained writes them) as the last shard, then
    config.json (and the per-layer modeling file), generation_config.json, the shard index, the tokenizer."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = lazy.model
    total = len(lazy.prefixes) + 1
    rest = {k: v for k, v in model.state_dict().items() if not any(k.startswith(p) for p in lazy.prefixes)}
    _write(remove_tied_weights_from_state_dict(rest, model), folder / shard_name(total, total), store, index, names)
    config = planned.config
    config.architectures, config.dtype = [planned.architecture], str(store).removeprefix("torch.")
    config.save_pretrained(folder)
    if planned.layout == "per-layer":
        family = model.config.model_type
        shutil.copyfile(modeling.source(family), folder / modeling.file_name(family))
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer.save_pretrained(folder)


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def verify_streamed(folder: Path, dtype: torch.dtype, device, ids: torch.Tensor, want: torch.Tensor,
                    want_cached: torch.Tensor | None) -> tuple[float, bool | None, str]:
    """Read `folder` back a block at a time: its logits for `ids` within ATOL of `want` (B, T, V), and for a
    causal LM, decoding through the KV cache (CACHED tokens, then the rest), the logits `want_cached`
    (B, T - CACHED, V) and the same next tokens. Returns (max diff, generation checked or None, route)."""
    back = lazy_model(folder, str(dtype).removeprefix("torch."), str(device))
    name = f"pruner layer by layer ({back.cls.__name__})"
    read = _Expected(back.model, device, dtype, ids)  # its own dtype: the rounded chain is the plain one
    for layer in range(len(back.prefixes)):  # every written block read once, for both checks
        read.run(back.onload(layer))
        back.offload(layer)
    got, _, cached = read.logits()
    diff = (got - want).abs().max().item()
    if not diff <= saving.ATOL:
        raise CheckpointError(f"the written checkpoint reloads ({name}) with logits off by {diff:.2e} "
                              f"(more than {saving.ATOL:g}); nothing was published")
    if want_cached is None:
        return diff, None, name
    off = (cached - want_cached).abs().max().item()
    if not off <= saving.ATOL or not torch.equal(cached.argmax(-1), want_cached.argmax(-1)):
        raise CheckpointError(f"the written checkpoint ({name}) decodes through the KV cache with logits off by "
                              f"{off:.2e} or other next tokens; nothing was published")
    return max(diff, off), True, name
