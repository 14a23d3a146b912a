"""How a drafter shares its target's frozen input embedding and LM head: attaching them, following the target's
device and dtype for generation (and restoring the drafter's own precision afterwards), and embedding tokens with
them. A mixin of `DraftPreTrainedModel`, which sets `_target_heads` and `_precision_stash` in its `__init__`."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .errors import DrafterLoadError, DrafterTargetMismatchError
from .target_info import check_drafter_matches_target


_RUNNABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Target dtypes a drafter follows in `attach_target(follow=True)`; under any other (float8 storage, quantized
weights reported as integers) it keeps its own dtype and its inputs are cast to it."""


class _TargetHeads:
    """Holds the target's embedding and LM head without registering them as drafter submodules, so they are
    neither saved with the drafter nor trained by it."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.draft_weight: torch.Tensor | None = None  # LM-head rows of the draft vocabulary, sliced once


class TargetBindingMixin:
    """The target-sharing half of `DraftPreTrainedModel` (an `nn.Module`): the target's embedding and LM head are
    held in `_target_heads`, never registered as submodules, so they are neither saved nor trained with the drafter;
    `_precision_stash` keeps the weights a dtype-following cast replaced."""

    _target_heads: _TargetHeads | None
    _precision_stash: list[tuple] | None

    def check_compatible(self, target_config: PreTrainedConfig) -> None:
        check_drafter_matches_target(self.config, target_config)

    def attach_target(self, target: PreTrainedModel, *, follow: bool = False) -> None:
        """Share ``target``'s (frozen) input embedding and LM head; with ``follow``, first move the drafter beside
        them. `generate()` calls `attach_target(target, follow=True)` for you.

        Args:
            target: the causal LM the drafter was built for (loaded with `AutoModelForCausalLM`).
            follow: what generation wants. True moves the drafter to the device of the target's LM head, which
                computes its logits (with a `device_map` spreading the target over several devices, the drafter
                goes with the LM head; its token embeddings come back from the embedding's device, and the target's
                features must be moved to `drafter.device`), and casts it to the target's dtype when that is a
                dtype it can run in (float16, bfloat16, float32, float64): a float32 drafter drafts for a bfloat16
                target in bfloat16, as if it had been loaded with `dtype=torch.bfloat16`. The weights it replaces are
                kept: `restore_own_precision()` (which generate() calls when it returns, and the next following
                attach does first) brings the drafter's own back bit for bit. A drafter whose weights
                are not loaded (meta) or that is spread over several devices cannot follow and is refused, as is
                a target whose LM head is offloaded. False, the default and what training passes, changes nothing
                on the drafter: a float32 drafter being trained stays float32 beside a bfloat16 target, and one on
                another device than the target's embedding or LM head is refused with the fix.
        """
        self.check_compatible(target.config)
        lm_head = target.get_output_embeddings()
        if lm_head is None:
            raise DrafterTargetMismatchError(
                f"{type(target).__name__} has no LM head; load the target with AutoModelForCausalLM."
            )
        embedding = target.get_input_embeddings()
        if follow:
            self._follow(target, embedding, lm_head)
        else:
            mine = next(self.parameters()).device
            for name, module in (("input embedding", embedding), ("LM head", lm_head)):
                theirs = module.weight.device
                if theirs != mine:
                    raise DrafterTargetMismatchError(
                        f"the drafter is on {mine} but the target's {name} is on {theirs}: the drafter runs on its "
                        f"target's features and shares its embedding and LM head. Move it with "
                        f"drafter.to({str(theirs)!r}), or attach it with attach_target(target, follow=True), which "
                        "moves it and casts it to the target's dtype (what generate() does)."
                    )
        self._target_heads = _TargetHeads(embedding, lm_head)

    def attach_stored_heads(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use a checkpoint's frozen copies of its target's input embedding (V, d) and LM head (V, d) until a target
        is attached (DeepSpec stores them), so the drafter runs, and its logits can be compared, with no target
        loaded. `attach_target` replaces them with the target's own; they are never saved with the drafter."""
        vocab, hidden = self.config.vocab_size, self.config.hidden_size
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(weight.shape) != (vocab, hidden):
                raise DrafterLoadError(f"the stored {name} has shape {tuple(weight.shape)}, but the drafter's target "
                                       f"has vocab_size {vocab} and hidden_size {hidden}; the checkpoint is corrupt.")
        embedding = nn.Embedding.from_pretrained(embed_tokens.detach(), freeze=True)
        head = nn.Linear(hidden, vocab, bias=False, device=lm_head.device, dtype=lm_head.dtype).requires_grad_(False)
        head.weight.data = lm_head.detach()
        self._target_heads = _TargetHeads(embedding, head)

    def _follow(self, target: PreTrainedModel, embedding: nn.Module, lm_head: nn.Module) -> None:
        """`attach_target(follow=True)`: move the drafter to the LM head's device and cast it to the target's dtype,
        or say why it cannot."""
        head_device = lm_head.weight.device
        if head_device.type == "meta":
            raise DrafterTargetMismatchError(
                f"the target's LM head is offloaded (its weight is on the meta device, loaded only while "
                f"{type(target).__name__} runs), but the drafter computes its logits with that weight directly. Keep "
                "the LM head on a device: load the target without offloading, or with a device_map that puts "
                "'lm_head' on a GPU or the CPU."
            )
        if embedding.weight.device.type == "meta" and not hasattr(embedding, "_hf_hook"):
            raise DrafterTargetMismatchError(
                "the target's input embedding has no weights (meta device) and no offloading hook to load them; "
                "load the target's weights before generating."
            )
        unloaded = [name for name, param in self.named_parameters() if param.device.type == "meta"]
        if unloaded:
            raise DrafterTargetMismatchError(
                f"the drafter cannot follow its target to {head_device}: {len(unloaded)} of its weights "
                f"({unloaded[0]}, ...) are on the meta device, not loaded. Load the drafter whole, e.g. "
                "AutoModel.from_pretrained(path) or hf_dspark.models.loading.load_drafter(path, dtype, device), "
                "without a device_map."
            )
        spread = {str(place) for place in (getattr(self, "hf_device_map", None) or {}).values()}
        if len(spread) > 1:
            raise DrafterTargetMismatchError(
                f"the drafter is spread over {', '.join(sorted(spread))} by a device_map, but a drafter runs whole "
                f"beside its target's LM head ({head_device}); load it without device_map and generation moves it."
            )
        self.restore_own_precision()  # a cast for an earlier target starts again from the drafter's own weights
        if any(param.device != head_device for param in self.parameters()):
            self.to(head_device)
        dtype = target.dtype
        if dtype in _RUNNABLE_DTYPES:
            self._cast_floating_weights(dtype)

    def _cast_floating_weights(self, dtype: torch.dtype) -> None:
        """Cast floating parameters and saved buffers to ``dtype``, keeping the tensors they replace so that
        `restore_own_precision` brings back the drafter's own weights bit for bit. Buffers no checkpoint holds
        (rotary inverse frequencies, computed in float32 at init) keep their precision, as
        `from_pretrained(dtype=...)` leaves them, so a drafter cast here drafts exactly as one loaded in ``dtype``."""
        stash = []
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    original = param.data
                    param.data = original.to(dtype)
                    stash.append((module, "parameter", name, original, param.data_ptr(), param._version))
            for name, buffer in module.named_buffers(recurse=False):
                if (buffer.is_floating_point() and buffer.dtype != dtype
                        and name not in module._non_persistent_buffers_set):
                    module._buffers[name] = cast = buffer.to(dtype)
                    stash.append((module, "buffer", name, buffer, cast.data_ptr(), cast._version))
        if stash:
            self._precision_stash = stash

    def restore_own_precision(self) -> bool:
        """Undo the dtype cast of `attach_target(follow=True)`: the drafter's weights as they were before it, bit
        for bit (a float32 drafter used with a bfloat16 target drafts in bfloat16, then is float32 again; a cast
        and a cast back would round it). generate() calls this when it returns. Weights changed since the cast
        (trained, loaded, cast by hand) are the user's: they are kept and the old ones dropped. Returns whether
        anything was restored."""
        stash, self._precision_stash = self._precision_stash, None
        if not stash:
            return False
        current = [module._parameters[name] if kind == "parameter" else module._buffers[name]
                   for module, kind, name, *_ in stash]
        if any(tensor is None or tensor.data_ptr() != pointer or tensor._version != version
               for tensor, (*_, pointer, version) in zip(current, stash)):
            return False
        for tensor, (module, kind, name, original, *_) in zip(current, stash):
            original = original.to(tensor.device)  # where the drafter went with its target
            if kind == "parameter":
                tensor.data = original
            else:
                module._buffers[name] = original
        return True

    def get_input_embeddings(self) -> None:
        """None: the drafter owns no embedding (it uses its target's, see `attach_target`). Said explicitly because
        transformers' default raises, and FSDP2 preparation (accelerate) asks for it to shard the embedding apart;
        the target's frozen embedding and LM head must stay out of the drafter's sharding."""
        return None

    def get_output_embeddings(self) -> None:
        """None: the drafter owns no LM head (its target's is shared, not a drafter parameter)."""
        return None

    @property
    def target_heads(self) -> _TargetHeads:
        if self._target_heads is None:
            raise RuntimeError(
                f"{type(self).__name__} shares its target's embedding and LM head, and none is attached. "
                "Call `drafter.attach_target(target)` first (generate() and the trainer do it for you)."
            )
        return self._target_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``input_ids``, on the drafter's device: with a `device_map` the target's
        embedding may sit on another device than its LM head, beside which the drafter runs (`attach_target`).
        With `config.input_embedding_scale` (z-lab DFlash's setting), the embedding weight's raw rows times that
        scale, multiplied in the weight's dtype as z-lab does, bypassing any scaling inside the target's module."""
        embedding = self.target_heads.embed_tokens
        scale = getattr(self.config, "input_embedding_scale", None)
        if embedding.weight.device.type != "meta":  # meta: an offloading hook moves the ids itself
            input_ids = input_ids.to(embedding.weight.device)
        elif scale is not None:
            raise DrafterTargetMismatchError(
                "this drafter embeds with its target's raw embedding rows (input_embedding_scale), but the target's "
                "embedding is offloaded (meta device); load the target with its embedding on a device.")
        if scale is not None:
            return (nn.functional.embedding(input_ids, embedding.weight) * float(scale)).to(self.device)
        return embedding(input_ids).to(self.device)


__all__ = ["TargetBindingMixin"]
