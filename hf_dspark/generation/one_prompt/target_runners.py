"""The target's forward passes in the batch-1 loop: prefill, verification of a round's tokens, cache cropping.

`target_runner_for` picks how. The default runs the target eagerly on the `DynamicCache` that `generate` made. With a
static cache (`generate(..., cache_implementation="static")`, or a `StaticCache` passed in) the verification forwards
go through the target's compiled forward, as stock `generate` runs its decoding steps: `target.get_compiled_call(
generation_config.compile_config)` when `generate`'s own criteria allow compiling (a GPU, or a `compile_config` with
`_compile_all_devices`; `disable_compile` turns it off). Each verification is padded to one of a few bucket lengths,
so the compiled forward sees few shapes; the prefill runs eagerly, as in stock `generate`.

A target with recurrent or convolution layers (Qwen3.5 / Qwen3-Next gated DeltaNet, LFM2 short convolutions,
Nemotron-H Mamba-2) gets `RecurrentStateRunner`: such a layer holds one state that every verified token went into,
so dropping the rejected drafts needs the state after exactly the accepted ones. It uses transformers' own past
recording: each verification forward keeps the state after each of its tokens, and `crop` takes the accepted one
(`benchmarks/hybrid-state-restore/results.md` measures it against restoring a snapshot and replaying).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from ...models.errors import UserInputError
from ...transformers_internals.accessors import decoding_step_context, generate_would_compile, supports_logits_to_keep
from ...transformers_internals.cache_layers import attention_layer_types, cache_layers, use_static_layers
from ...transformers_internals.recurrent_states import (has_recurrent_layers, keep_recurrent_states,
                                                        stop_keeping_states, unkept_states_message)


class DynamicTargetRunner:
    """Eager forwards on a `DynamicCache`: every call appends its tokens; `crop` drops the rejected ones."""

    pads_to_buckets = False  # the loop pads to the cost table's cheapest size itself

    def __init__(self, target, cache, layer_indices: list[int]):
        self.target, self.cache, self.layer_indices = target, cache, layer_indices
        self._kwargs = {"logits_to_keep": None} if supports_logits_to_keep(target) else {}
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()  # sliding-window layers keep what a crop may need

    def forward(self, tokens: torch.LongTensor, keep: int):
        """Run `tokens` (1, N) after the cached ones; returns (model outputs with the drafter's hidden states,
        float32 logits of the last `keep` positions (1, keep, V))."""
        kwargs = {"logits_to_keep": keep} if self._kwargs else {}
        out = self.target(input_ids=tokens, cache=self.cache, use_cache=True,
                          output_hidden_states=self.layer_indices, **kwargs)
        return out, out.logits[:, -keep:].float()

    def crop(self, length: int) -> None:
        """Keep the first `length` cache entries (the committed sequence but its newest token)."""
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)

    def finish(self) -> None:
        """The loop is done with the cache (it may be returned to the caller)."""


class RecurrentStateRunner(DynamicTargetRunner):
    """Eager forwards on a `DynamicCache` with recurrent or convolution layers (a hybrid target), exact after
    rejected drafts.

    The prefill runs as plain `generate`'s does (chunked kernels, windows trimmed). From then on the cache records
    its past (`recurrent_states.keep_recurrent_states`): a verification forward of N tokens keeps a recurrent
    layer's state after each of them (the layer runs those N tokens through its one-token kernel, the one plain
    decoding steps use) and a convolution layer its whole input window, and `crop` hands each layer the state after
    the last kept token, dropping the rest; attention layers crop their entries as usual. `crop` runs after every
    forward, also when nothing was rejected: it trims the windows back to the kernel's size.

    Args:
        target, cache, layer_indices: as for `DynamicTargetRunner`.
        longest: the most tokens a verification forward is expected to hold; a longer one raises the count kept.
    """

    def __init__(self, target, cache, layer_indices: list[int], longest: int):
        self.target, self.cache, self.layer_indices = target, cache, layer_indices
        self._kwargs = {"logits_to_keep": None} if supports_logits_to_keep(target) else {}
        self.longest, self.kept = longest, 0  # states kept per forward: 0 until the prefill has run
        self.length = 0  # cached positions, kept here (a recurrent layer's count is a device tensor)

    def forward(self, tokens: torch.LongTensor, keep: int):
        if self.length and tokens.shape[1] > self.kept:  # every forward after the prefill; the kept states are
            self.kept = max(self.longest, tokens.shape[1])  # empty here (`crop` dropped them)
            keep_recurrent_states(self.cache, self.kept)
        out, logits = super().forward(tokens, keep)
        self.length += tokens.shape[1]
        return out, logits

    def crop(self, length: int) -> None:
        excess = self.length - length
        if self.kept:
            self.cache.crop(-excess)
        elif excess:  # the prefill, which is never cropped back
            raise RuntimeError("the prefill cannot be cropped on a cache with recurrent layers")
        self.length = length

    def finish(self) -> None:
        """Keep only the newest states again, as stock `generate` leaves a cache it returns."""
        if self.kept:
            stop_keeping_states(self.cache)
            self.kept = 0


def verification_buckets(num_draft_slots: int, costs=None) -> tuple[int, ...]:
    """The forward sizes a compiled verification is padded to, covering every round of a drafter with
    `num_draft_slots` slots (1 to `num_draft_slots` + 1 tokens). With a cost table `costs`, the sizes it pads to
    (`padded_tokens`, the cheapest forward at or above each count); without, powers of two below `num_draft_slots` + 1,
    then `num_draft_slots` + 1."""
    most = num_draft_slots + 1
    if costs is not None:
        return tuple(sorted({costs.padded_tokens(n) for n in range(1, most + 1)}))
    return tuple(1 << k for k in range(most.bit_length()) if 1 << k < most) + (most,)


class StaticTargetRunner:
    """Forwards on a static cache: the prefill eagerly, every verification padded up to a bucket length and run
    through `compiled_forward` (the target's compiled call), or everything eagerly when `compiled_forward` is None.

    The cache's layers are replaced by plain `StaticLayer`s of `capacity` entries when they are shorter or
    sliding-window layers: a static sliding-window layer drops the states that leave its window, which a crop after
    rejected drafts would need back. Full-length layers keep them; the target's sliding-window mask still limits what
    each position attends to, so the outputs are the sliding-window model's. The write position is kept by the layers
    themselves (a tensor, so moving it does not recompile); `crop` moves it back, and the stale entries past it are
    hidden by the causal mask until they are overwritten.

    A padded forward writes its dummy tokens (copies of the last real one) after the real ones; they cannot change
    the real positions' outputs (causal attention) and are cropped at once, so after `forward` the cache holds the
    real tokens only, as with `DynamicTargetRunner`.

    Args:
        target: the causal LM.
        cache: the `StaticCache` of this `generate` call, still empty.
        layer_indices: the hidden-state indices the drafter reads (`output_hidden_states=`).
        capacity: cache entries needed: the longest sequence plus the padding of its last verification.
        buckets: the padded lengths, ascending; None pads to the next power of two.
        compiled_forward: the target's compiled call, or None to run every forward eagerly at its real size.
    """

    pads_to_buckets = True  # every verification is padded to a bucket here

    def __init__(self, target, cache, layer_indices: list[int], capacity: int, buckets: tuple[int, ...] | None,
                 compiled_forward=None):
        self.target, self.cache, self.layer_indices = target, cache, layer_indices
        self.buckets, self.compiled_forward = buckets, compiled_forward
        self.capacity = _make_full_length(target, cache, capacity)
        self.length = 0  # cached positions, kept here so reading it never waits for the device
        self.compiled_lengths: set[int] = set()  # padded lengths run through `compiled_forward`
        self._keeps_logits = supports_logits_to_keep(target)
        decode = decoding_step_context(target)  # stock generate's decoding-step context
        self._decode_context = decode if decode is not None else contextlib.nullcontext

    def forward(self, tokens: torch.LongTensor, keep: int):
        """Run `tokens` (1, N) after the cached ones; returns (model outputs whose hidden states hold the N positions,
        float32 logits of the last `keep` of them (1, keep, V))."""
        num_tokens = tokens.shape[1]
        padded = self._padded_length(num_tokens)
        if padded is None:
            out = self._eager(tokens, keep)
            logits = out.logits[:, -keep:].float()
        else:
            # A fresh tensor even without padding: the loop passes a slice of the sequence, whose row stride changes
            # every round, and the compiled forward is specialised on strides too.
            inputs = tokens.new_empty((1, padded))
            inputs[:, :num_tokens] = tokens
            inputs[:, num_tokens:] = tokens[:, -1:]
            with self._decode_context():
                out = self.compiled_forward(input_ids=inputs, cache=self.cache,
                                            use_cache=True, output_hidden_states=self.layer_indices,
                                            **({"logits_to_keep": 0} if self._keeps_logits else {}))
            self.compiled_lengths.add(padded)
            if padded > num_tokens:
                self.cache.crop(num_tokens - padded)
            # Copies: a compiled call in "reduce-overhead" mode (CUDA graphs, CompileConfig's default) returns buffers
            # that its next run overwrites, and the loop keeps logits and features across forwards. The outputs then
            # look like an eager forward's: the kept logits, the real positions' hidden states.
            logits = out.logits[:, num_tokens - keep : num_tokens].to(dtype=torch.float32, copy=True)
            out.logits = logits
            out.hidden_states = tuple(None if h is None else h[:, :num_tokens].clone() for h in out.hidden_states)
        self.length += num_tokens
        return out, logits

    def crop(self, length: int) -> None:
        """Keep the first `length` cache entries (the committed sequence but its newest token)."""
        if self.length > length:
            self.cache.crop(length - self.length)
            self.length = length

    def finish(self) -> None:
        """The loop is done with the cache (it may be returned to the caller)."""

    def _eager(self, tokens, keep: int):
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        return self.target(input_ids=tokens, cache=self.cache, use_cache=True,
                           output_hidden_states=self.layer_indices, **kwargs)

    def _padded_length(self, num_tokens: int) -> int | None:
        """The bucket a forward of `num_tokens` runs at through the compiled call, or None to run it eagerly: the
        prefill (as stock generate does; it also allocates the cache's tensors outside the compiled region), any
        forward when nothing is compiled, and one that no bucket holds or whose padding would not fit the cache."""
        if self.compiled_forward is None or self.length == 0:
            return None
        if self.buckets is None:
            padded = 1 << (num_tokens - 1).bit_length()
        else:
            padded = next((b for b in self.buckets if b >= num_tokens), None)
        if padded is None or self.length + padded > self.capacity:
            return None
        return padded


def _make_full_length(target, cache, capacity: int) -> int:
    """Give `cache` full-attention static layers of at least `capacity` entries (kept when it has them already);
    returns the capacity it ends with. Targets with other layer kinds are refused before any forward."""
    layer_types = set(attention_layer_types(target.config))
    unsupported = sorted(layer_types - {"full_attention", "sliding_attention"})
    kinds = {type(layer) for layer in cache_layers(cache)}
    if unsupported or not kinds <= {StaticLayer, StaticSlidingWindowLayer}:
        found = unsupported or sorted(kind.__name__ for kind in kinds)
        raise ValueError(
            f"hf_dspark's static-cache verification supports targets made of full and sliding-window attention "
            f"layers; {type(target).__name__} has {found}. Drop cache_implementation='static' (or the StaticCache "
            "passed in): the default dynamic cache verifies this target eagerly."
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            "an offloaded static cache (cache_implementation='offloaded_static') is not supported by hf_dspark's "
            "static-cache verification; use cache_implementation='static', or the default dynamic cache."
        )
    if kinds == {StaticLayer} and min(layer.max_cache_len for layer in cache_layers(cache)) >= capacity:
        return min(layer.max_cache_len for layer in cache_layers(cache))
    use_static_layers(target, cache, capacity)  # and tells generate, as its own static caches do
    return capacity


# Static caches are allocated in multiples of this many entries: the compiled forward is specialised on the cache's
# length, so calls whose prompt or max_new_tokens differ a little reuse the same shapes instead of recompiling.
_CACHE_GRANULE = 256


def _static_capacity(cache, generation_config, buckets: tuple[int, ...] | None) -> int:
    """Entries for the whole generation (`max_length` - 1: the newest token is never cached) plus the padding of its
    last verification, which may start one position before that end; a cache already that long is kept."""
    needed = generation_config.max_length - 1
    # Without buckets (powers of two, no known largest round), a padded forward that would not fit runs eagerly.
    if buckets is not None:
        needed += max(buckets) - 1
    if cache.get_max_length() >= needed:
        return cache.get_max_length()
    return -(-needed // _CACHE_GRANULE) * _CACHE_GRANULE


def target_runner_for(target, cache, generation_config, layer_indices: list[int], num_draft_slots: int | None = None,
                      cost_table=None):
    """The runner for this `generate` call: `StaticTargetRunner` on a `StaticCache` (compiled when `generate` would
    compile its own decoding steps), else `DynamicTargetRunner` (`RecurrentStateRunner` for a hybrid target).
    `num_draft_slots` and `cost_table` set the bucket lengths (`verification_buckets`); without them verifications
    are padded to powers of two."""
    if not isinstance(cache, StaticCache):
        if not has_recurrent_layers(cache):
            return DynamicTargetRunner(target, cache, layer_indices)
        refusal = unkept_states_message(cache, target)
        if refusal is not None:
            raise UserInputError(refusal)
        longest = max(verification_buckets(num_draft_slots, cost_table)) if num_draft_slots is not None else 1
        return RecurrentStateRunner(target, cache, layer_indices, longest)
    buckets = verification_buckets(num_draft_slots, cost_table) if num_draft_slots is not None else None
    capacity = _make_full_length(target, cache, _static_capacity(cache, generation_config, buckets))
    # Asked after the layers are in place: generate's criteria read the cache (is it compilable?).
    compiled = (target.get_compiled_call(generation_config.compile_config)
                if generate_would_compile(target, cache, generation_config) else None)
    return StaticTargetRunner(target, cache, layer_indices, capacity, buckets, compiled)
