"""How a drafter shares its target's frozen input embedding and LM head: attaching them, following the target's
device and dtype for generation (`for_target`: a per-call view, over a cached copy when the drafter must be cast or
moved, so that calls with targets of different dtypes can share one drafter from several threads; or in place with
`attach_target(follow=True)`, restored by `restore_own_precision`), and embedding tokens with them. A mixin of
`DraftPreTrainedModel`, which sets `_target_heads` and `_precision_stash` in its `__init__`."""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .errors import DrafterLoadError, DrafterTargetMismatchError
from .target_info import check_drafter_matches_target


_RUNNABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Target dtypes a drafter follows in `attach_target(follow=True)`; under any other (float8 storage, quantized
weights reported as integers) it keeps its own dtype and its inputs are cast to it."""

_BINDING_LOCK = threading.RLock()
"""Held while a drafter's weights are restored or cast in place, and while a cast copy is looked up or built."""

_CAST_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per drafter, its cast copies by (device, dtype) (`for_target`); they leave with the drafter."""


@dataclass
class _CastCopy:
    """A drafter's weights cast for one (device, dtype), valid while the drafter's own are those it was made from."""

    model: nn.Module
    fingerprint: list  # per weight: (module id, name, data pointer, version, training flag) when it was made
    sources: list  # the weights it was made from, held so that no new weight can take their memory address


class _TargetHeads:
    """Holds the target's embedding and LM head without registering them as drafter submodules, so they are
    neither saved with the drafter nor trained by it."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.draft_weight: torch.Tensor | None = None  # LM-head rows of the draft vocabulary, sliced once


class _ScaledEmbedding(nn.Embedding):
    """A frozen embedding whose rows are multiplied by `scale` in the weight's dtype (Gemma's scaled embedding)."""

    def __init__(self, weight: torch.Tensor, scale: float):
        super().__init__(*weight.shape, _weight=weight, _freeze=True, device=weight.device, dtype=weight.dtype)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A float32 scalar cast to the weight's dtype, as Gemma's module casts its float32 `embed_scale` buffer.
        return super().forward(input_ids) * torch.tensor(self.scale, device=self.weight.device).to(self.weight.dtype)


class TargetBindingMixin:
    """The target-sharing half of `DraftPreTrainedModel` (an `nn.Module`): the target's embedding and LM head are
    held in `_target_heads`, never registered as submodules, so they are neither saved nor trained with the drafter;
    `_precision_stash` keeps the weights an in-place dtype-following cast (`attach_target(follow=True)`) replaced.

    Thread safety: generate() runs `for_target(target)`, a view of its own per call, so calls from several threads
    may share one drafter, with targets of the same or of different dtypes and devices. What changes the drafter in
    place is not: `attach_target(follow=True)` (and a `SpeculativeEngine` built on the drafter, which calls it),
    training, loading or editing its weights, while another thread generates with it."""

    _target_heads: _TargetHeads | None
    _precision_stash: list[tuple] | None

    def check_compatible(self, target_config: PreTrainedConfig) -> None:
        check_drafter_matches_target(self.config, target_config)

    def attach_target(self, target: PreTrainedModel, *, follow: bool = False) -> None:
        """Share ``target``'s (frozen) input embedding and LM head; with ``follow``, first move the drafter beside
        them, in place. generate() does not call this: it runs `for_target(target)`, which leaves the drafter's
        weights alone.

        Args:
            target: the causal LM the drafter was built for (loaded with `AutoModelForCausalLM`).
            follow: True moves the drafter to the device of the target's LM head, which computes its logits (with
                a `device_map` spreading the target over several devices, the drafter goes with the LM head; its
                token embeddings come back from the embedding's device, and the target's features must be moved to
                `drafter.device`), and casts it to the target's dtype when that is a dtype it can run in (float16,
                bfloat16, float32, float64): a float32 drafter drafts for a bfloat16 target in bfloat16, as if it
                had been loaded with `dtype=torch.bfloat16`. The weights it replaces are kept:
                `restore_own_precision()` (which generate() and the next following attach call first) brings the
                drafter's own back bit for bit. A drafter whose weights are not loaded (meta) or that is spread
                over several devices cannot follow and is refused, as is a target whose LM head is offloaded.
                False, the default and what training passes, changes nothing on the drafter: a float32 drafter
                being trained stays float32 beside a bfloat16 target, and one on another device than the target's
                embedding or LM head is refused with the fix.
        """
        embedding, lm_head = self._target_modules(target)
        if follow:
            self._check_can_follow(target, embedding, lm_head)
            self._follow(target, lm_head)
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

    def for_target(self, target: PreTrainedModel):
        """The drafter one generation call with ``target`` runs: beside the target's LM head, in its dtype (the
        rules of `attach_target(follow=True)`), attached to its embedding and LM head, and private to the call.

        When the drafter's weights already have that device and dtype, it is a view sharing them (no copy).
        Otherwise it is a view of a copy cast and moved once per (device, dtype) and kept for later calls, made
        again when the drafter's own weights change (trained, loaded, edited); the drafter's own weights stay as
        they are. Either way nothing of the drafter changes that another call reads, so calls from several
        threads may share one drafter, with targets of different dtypes too. A drafter cast in place by
        `attach_target(follow=True)` gets its own precision back first (`restore_own_precision`). The drafter
        itself is left attached to ``target``'s heads when it sits on their device, as `attach_target` leaves it.
        Returns a drafter of the same class; statistics a call writes on it stay on it."""
        embedding, lm_head = self._target_modules(target)
        self._check_can_follow(target, embedding, lm_head)
        device = lm_head.weight.device
        dtype = target.dtype if target.dtype in _RUNNABLE_DTYPES else None
        with _BINDING_LOCK:
            self.restore_own_precision()
            source = self._cast_copy(device, dtype) if self._needs_cast(device, dtype) else self
        if next(self.parameters()).device == device:
            self._target_heads = _TargetHeads(embedding, lm_head)
        view = object.__new__(type(self))  # shares every submodule and weight of `source`, not its attributes
        view.__dict__.update(source.__dict__)
        view.__dict__.update(_target_heads=_TargetHeads(embedding, lm_head), _precision_stash=None)
        return view

    def attach_stored_heads(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                            embed_scale: float | None = None) -> None:
        """Use a checkpoint's frozen copies of its target's input embedding (V, d) and LM head (V, d) until a target
        is attached (DeepSpec stores them), so the drafter runs, and its logits can be compared, with no target
        loaded. `embed_scale`: the embedding's rows are multiplied by it (in their dtype), as a Gemma target's
        embedding module does with sqrt(hidden_size). `attach_target` replaces them with the target's own; they
        are never saved with the drafter."""
        vocab, hidden = self.config.vocab_size, self.config.hidden_size
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(weight.shape) != (vocab, hidden):
                raise DrafterLoadError(f"the stored {name} has shape {tuple(weight.shape)}, but the drafter's target "
                                       f"has vocab_size {vocab} and hidden_size {hidden}; the checkpoint is corrupt.")
        embedding = nn.Embedding.from_pretrained(embed_tokens.detach(), freeze=True) if embed_scale is None else \
            _ScaledEmbedding(embed_tokens.detach(), embed_scale)
        head = nn.Linear(hidden, vocab, bias=False, device=lm_head.device, dtype=lm_head.dtype).requires_grad_(False)
        head.weight.data = lm_head.detach()
        self._target_heads = _TargetHeads(embedding, head)

    def _target_modules(self, target: PreTrainedModel) -> tuple[nn.Module, nn.Module]:
        """The target's input embedding and LM head, once the drafter is checked to fit it."""
        self.check_compatible(target.config)
        lm_head = target.get_output_embeddings()
        if lm_head is None:
            raise DrafterTargetMismatchError(
                f"{type(target).__name__} has no LM head; load the target with AutoModelForCausalLM."
            )
        return target.get_input_embeddings(), lm_head

    def _check_can_follow(self, target: PreTrainedModel, embedding: nn.Module, lm_head: nn.Module) -> None:
        """Refuse what cannot follow its target's LM head, saying why."""
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

    def _follow(self, target: PreTrainedModel, lm_head: nn.Module) -> None:
        """`attach_target(follow=True)`: move the drafter to the LM head's device and cast it to the target's dtype,
        in place."""
        head_device = lm_head.weight.device
        with _BINDING_LOCK:
            self.restore_own_precision()  # a cast for an earlier target starts again from the drafter's own weights
            if any(param.device != head_device for param in self.parameters()):
                self.to(head_device)
            dtype = target.dtype
            if dtype in _RUNNABLE_DTYPES:
                self._cast_floating_weights(dtype)

    def _own_weights(self):
        """Every parameter and buffer: (module, name, tensor, whether it takes the dtype the drafter follows)."""
        for module in self.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    yield module, name, param, param.is_floating_point()
            for name, buffer in module._buffers.items():
                if buffer is not None:  # buffers no checkpoint holds keep their precision (see below)
                    yield module, name, buffer, (buffer.is_floating_point()
                                                 and name not in module._non_persistent_buffers_set)

    def _needs_cast(self, device: torch.device, dtype: torch.dtype | None) -> bool:
        return any(tensor.device != device or (dtype is not None and follows and tensor.dtype != dtype)
                   for _, _, tensor, follows in self._own_weights())

    def _cast_copy(self, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
        """The drafter's copy on ``device`` in ``dtype`` (None: its own dtypes), made as `_follow` casts, kept per
        (device, dtype) and made again once the drafter's own weights are not those it was made from. Tensors
        that need no change (integer buffers on the device) are shared, not copied. Called under `_BINDING_LOCK`."""
        weights = list(self._own_weights())
        fingerprint = [(id(module), name, tensor.data_ptr(), tensor._version, module.training)
                       for module, name, tensor, _ in weights]
        copies = _CAST_COPIES.setdefault(self, {})
        for key in [key for key, kept in copies.items() if kept.fingerprint != fingerprint]:
            del copies[key]  # made from weights the drafter no longer has: freed before a successor is made
        if (device, dtype) in copies:
            return copies[(device, dtype)].model
        memo = {id(value): value for value in (self.config, getattr(self, "generation_config", None))}  # shared
        memo.update({id(self.__dict__.get(name)): None
                     for name in ("_target_heads", "_precision_stash", "last_generation_stats")})
        for module, name, tensor, follows in weights:
            if id(tensor) not in memo:  # tied weights stay tied
                moved = tensor.detach().to(device)
                moved = moved.to(dtype) if dtype is not None and follows else moved
                memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if name in module._parameters else moved
        model = copy.deepcopy(self, memo)
        copies[(device, dtype)] = _CastCopy(model, fingerprint, [tensor.detach() for _, _, tensor, _ in weights])
        return model

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
        """Undo the in-place dtype cast of `attach_target(follow=True)`: the drafter's weights as they were before
        it, bit for bit (a float32 drafter that followed a bfloat16 target is float32 again; a cast and a cast back
        would round it). generate() calls this before it runs (it never casts in place itself). Weights changed
        since the cast (trained, loaded, cast by hand) are the user's: they are kept and the old ones dropped.
        Returns whether anything was restored."""
        with _BINDING_LOCK:
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
