"""The attention the engine's target forwards run (`mask_taking_attention`), and the check that it is transformers'
own (`attention_problems`, pinned by tests/coexistence/test_transformers_internals.py).

What is relied on (transformers 5.24): attention layers look their function up from `config._attn_implementation`
at every forward (`_attn_implementation_internal` of the config and of each of its `sub_configs`), in
`AttentionInterface`, and the mask builders theirs in `AttentionMaskInterface`; `sdpa_attention_forward(module,
query, key, value, attention_mask, dropout=, scaling=, is_causal=, **kwargs)` returns `(output (B, Q, H, D), None)`;
`sdpa_mask(..., allow_is_causal_skip=)`.

Why an implementation of our own: for grouped-query attention over more than one query per row with a mask (every
verification forward of the engine: its caches have holes), transformers' sdpa copies every key and value head
`num_key_value_groups` times (`repeat_kv`) before calling torch, because CUDA's fused kernels cannot take a mask with
`enable_gqa`. On the CPU torch's kernel takes both and computes the same numbers without the copy. Profiled at 12 rows
of SmolLM2-135M (3 key-value heads for 9 query heads, about 400 cached entries): the copy was 8 % of a round, 0.55 s
of 7.1 s over a run of 56 rounds, and the attention kernel is about 3x faster without it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GROUPED_SDPA = "hf_dspark_grouped_sdpa"  # transformers' sdpa, with torch's grouped-query kernel where it is exact


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward`, but for grouped-query attention on the CPU with a mask and more than
    one query, where it hands torch the key-value heads as they are (`enable_gqa`) instead of copies of them."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain_kwargs = not any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "sinks", "s_aux"))
    if (groups > 1 and query.shape[2] > 1 and attention_mask is not None and query.device.type == "cpu"
            and dropout == 0.0 and plain_kwargs and key.shape[-1] == value.shape[-1]):
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                                  scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _grouped_sdpa_mask(*args, **kwargs):
    """sdpa's mask, always built: a model may treat a skipped (None) mask differently when its implementation is not
    called "sdpa" (Gemma 4 then drops early queries), and the grouped path needs a mask anyway."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, _grouped_sdpa_mask)


def _configs(config) -> list:
    """`config` and every config nested in it (`sub_configs`), each once."""
    found, stack = [], [config]
    while stack:
        current = stack.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        stack.extend(getattr(current, name, None) for name in getattr(current, "sub_configs", {}) or {})
    return found


@contextmanager
def mask_taking_attention(model):
    """Inside, `model`'s attention layers run an implementation that takes the engine's 4D masks: sdpa (as
    `grouped_sdpa_attention`) where the model was loaded with sdpa or one that does not take them (flash attention
    takes padding as sequence lengths, not holes), eager where it was loaded with eager or has no sdpa. The same
    attention, computed by another kernel; each config's own setting is restored on exit, whatever happens inside.
    Several threads sharing one model see the swap while a forward runs."""
    key = "_attn_implementation_internal"
    replacement = GROUPED_SDPA if getattr(model, "_supports_sdpa", True) else "eager"
    swapped = [c for c in _configs(model.config) if c.__dict__.get(key) not in (None, "eager", replacement)]
    saved = [config.__dict__[key] for config in swapped]
    try:
        for config in swapped:
            config.__dict__[key] = replacement
        yield
    finally:
        for config, value in zip(swapped, saved):
            config.__dict__[key] = value


def attention_problems(reference=sdpa_attention_forward) -> list[str]:
    """What the installed transformers no longer does of what `grouped_sdpa_attention` relies on (empty when all
    holds): it must compute what transformers' sdpa (`reference`, a parameter so that the check can be tested on
    stand-ins) does, on a grouped-query layer with holes in its mask."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, groups, queries, keys, dim = 2, 2, 3, 4, 9, 8
    query = torch.randn(batch, heads * groups, queries, dim, generator=generator)
    key, value = (torch.randn(batch, heads, keys, dim, generator=generator) for _ in range(2))
    mask = torch.rand(batch, 1, queries, keys, generator=generator) > 0.3
    mask[..., -1] = True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    try:
        ours, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=dim ** -0.5)
        theirs, _ = reference(module, query, key, value, mask, dropout=0.0, scaling=dim ** -0.5)
    except (TypeError, ValueError, RuntimeError) as error:
        return [f"sdpa_attention_forward(module, query, key, value, attention_mask, dropout=, scaling=) no longer "
                f"works as called: {type(error).__name__}: {error}"]
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=1e-6):
        return [f"sdpa_attention_forward's output ({tuple(theirs.shape)}) differs from torch's grouped-query sdpa "
                f"({tuple(ours.shape)}): update grouped_sdpa_attention"]
    built = _grouped_sdpa_mask(batch_size=1, q_length=2, kv_length=2, attention_mask=torch.ones(1, 2, dtype=torch.bool))
    if built is None:
        return ["sdpa_mask(allow_is_causal_skip=False) skipped the mask: update _grouped_sdpa_mask"]
    return []
