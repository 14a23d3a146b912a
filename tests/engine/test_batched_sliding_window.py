"""Targets with sliding-window layers in the batched engine: every row equals its prompt's own plain greedy decoding.

The engine's target cache keeps holes, and transformers' sliding-window mask counts cache slots, holes included; the
engine masks by position instead (hf_dspark/generation/engine/masks.py). The window here (3) is far smaller than
prompt + generation, and the drafts are rigged so that rows accept different numbers of them (holes at different
places in every row). `test_logits_after_holes_are_each_rows_own` compares logits, which a wrong window moves even
where a random target's argmax does not; `test_a_slot_counted_window_changes_the_output` shows the token checks catch a
window counted in slots, or one left out."""

from types import SimpleNamespace

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Llama4TextConfig,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3_5TextConfig, Qwen3ForCausalLM, Qwen3NextConfig)
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

import hf_dspark.generation.engine.speculative_engine as batched
import hf_dspark.generation.engine.passes as engine_rounds
from hf_dspark.transformers_internals.recurrent_states import keeps_states_per_position
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.generation.engine.checks import new_target_cache
from hf_dspark.generation.engine import masks as engine_masks
from hf_dspark.generation.engine.masks import FULL, SLIDING, MaskKinds, mask_kinds, target_attention_mask
from factories import VOCAB, prompts, tiny_drafter, tiny_target
from batch_helpers import assert_rows_equal, left_pad, run_staggered, use_oracle

WINDOW = 3
MAX_NEW = 14
FAMILIES = ["gemma3", "mistral", "qwen2", "qwen3"]


def sliding_target(family: str, **overrides):
    """Tiny random targets: Gemma 3 and Qwen 2/3 mix full and sliding layers, Mistral slides on every layer."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, initializer_range=0.2, sliding_window=WINDOW)
    common.update(overrides)
    if family == "gemma3":
        layer_types = [SLIDING, FULL, SLIDING, SLIDING]
        return Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, layer_types=layer_types, **common)).eval()
    if family == "gemma2":  # attention logit soft-capping: eager attention only
        common["attn_implementation"] = "eager"
        return Gemma2ForCausalLM(Gemma2Config(head_dim=16, layer_types=[SLIDING, FULL] * 2, **common)).eval()
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(head_dim=16, **common)).eval()
    # Qwen: layers from max_window_layers on slide, when use_sliding_window is set
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, use_sliding_window=True, max_window_layers=1, **common)).eval()


def references_for(target, prompt_list, max_new: int) -> list[torch.Tensor]:
    return [target.generate(p, do_sample=False, max_new_tokens=max_new)[0] for p in prompt_list]


def slot_counted(target, cached_valid, new_valid, positions):
    """The engine's mask before sliding targets ran: the 2D padding mask, transformers windowing by cache slot."""
    return torch.cat([cached_valid, new_valid], dim=1).long()


def run_rigged(monkeypatch, target, prompt_list, references):
    """`batched_speculative_generate` with drafts the target accepts 0..4 of, varying by row and round."""
    use_oracle(monkeypatch, references, block_size=4)
    ids, mask = (tensor.to(target.device) for tensor in left_pad([p.cpu() for p in prompt_list]))
    drafter = tiny_drafter(target, "markov", block_size=4).to(target.device)
    drafter.generation_config.dspark_round_planning = False  # every round verifies the rigged drafts
    return batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, policy="all")


# ---------------------------------------------------------------------------------------------------------
# The masks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_masks_by_position_are_transformers_own_on_a_cache_without_holes(family):
    target = sliding_target(family)
    length = 12
    valid, positions = torch.ones(1, length, dtype=torch.bool), torch.arange(length)[None]
    masks = target_attention_mask(target, valid[:, :0], valid, positions)
    sliding = masks if torch.is_tensor(masks) else masks[SLIDING]
    # The window convention: a key is in the window while q - kv < sliding_window.
    expected = sdpa_mask(batch_size=1, q_length=length, kv_length=length, allow_is_causal_skip=False,
                         mask_function=sliding_window_causal_mask_function(WINDOW))
    assert torch.equal(sliding, expected)
    if not torch.is_tensor(masks):
        assert torch.equal(masks[FULL], torch.ones(length, length, dtype=torch.bool).tril()[None, None])
    ids = prompts(1, length=length)[0]
    with torch.no_grad():
        assert torch.equal(target(ids, attention_mask=masks, position_ids=positions).logits, target(ids).logits)


def test_a_hole_query_sees_itself_and_eager_masks_are_additive():
    """A query that is itself a hole, after nothing but holes, must not get a fully masked row (NaN in sdpa)."""
    target = sliding_target("gemma3")
    cached = torch.tensor([[False, False], [True, True]])
    new_valid = torch.tensor([[False, True], [True, False]])
    positions = torch.tensor([[0, 0], [2, 3]])
    masks = target_attention_mask(target, cached, new_valid, positions)
    assert set(masks) == {FULL, SLIDING}
    for mask in masks.values():
        assert mask.dtype == torch.bool and mask.shape == (2, 1, 2, 4) and bool(mask.any(dim=-1).all())
    # Row 0: a left-pad query (position 0, clamped) sees itself and the real token at position 0.
    assert masks[SLIDING][0, 0].tolist() == [[False, False, True, True], [False, False, False, True]]
    # Row 1: its padded query (position 3) sees positions 1 and 2 (window 3), not 0, and itself.
    assert masks[SLIDING][1, 0].tolist() == [[True, True, True, False], [False, True, True, True]]
    assert masks[FULL][1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    eager = target_attention_mask(sliding_target("gemma2"), cached, new_valid, positions)
    minimum = torch.finfo(torch.float32).min
    assert torch.equal(eager[SLIDING], torch.where(masks[SLIDING], 0.0, minimum))
    # Full-attention targets keep the 2D padding mask: transformers' causal mask by slot is right for them. In a
    # one-token forward a non-hybrid one gets the mask of the real entries (transformers would read a padding mask
    # on the host), equal to the full mask by position; a hybrid one still the padding mask, which its recurrent
    # layers read.
    llama = tiny_target("llama")
    padding = torch.cat([cached, new_valid], dim=1).long()
    assert torch.equal(target_attention_mask(llama, cached, new_valid, positions), padding)
    one = torch.tensor([[True], [True]])
    by_position = target_attention_mask(sliding_target("gemma3"), cached, one, positions[:, 1:])[FULL]
    assert torch.equal(target_attention_mask(llama, cached, one, positions[:, 1:]), by_position)
    lfm2 = tiny_target("lfm2")
    assert torch.equal(target_attention_mask(lfm2, cached, one, positions[:, 1:]), torch.cat([cached, one], 1).long())


# ---------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_match_plain_greedy(monkeypatch, family, count, device):
    target = sliding_target(family).to(device)  # on CUDA too where there is one (sdpa kernels differ there)
    prompt_list = prompts(count, length=5, seed=3, device=device)  # 5, 6, 7 tokens: left padding differs by row
    references = references_for(target, prompt_list, MAX_NEW + 8)
    out = run_rigged(monkeypatch, target, prompt_list, references)
    assert min(p.shape[1] for p in prompt_list) + MAX_NEW > 5 * WINDOW  # the window moves on long before the end
    assert_rows_equal(out, [r[: p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)])
    assert len({a for s in out.stats for a in s.accepted}) >= 2  # rows kept different numbers of drafts


def test_eager_attention_with_soft_capping_matches_plain_greedy(monkeypatch):
    target = sliding_target("gemma2")
    prompt_list = prompts(3, length=5, seed=3)
    references = references_for(target, prompt_list, MAX_NEW + 8)
    out = run_rigged(monkeypatch, target, prompt_list, references)
    assert_rows_equal(out, [r[: p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)])


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen3"])
def test_requests_joining_late_and_finishing_apart_match_plain_greedy(monkeypatch, family):
    target = sliding_target(family)
    prompt_list = prompts(4, length=5, seed=3) + [prompts(1, length=11, seed=7)[0]]  # a longer newcomer
    max_new = {0: 14, 1: 5, 2: 12, 3: 9, 4: 8}
    arrivals = {0: 0, 1: 0, 2: 2, 3: 3, 4: 5}
    references = references_for(target, prompt_list, 22)
    use_oracle(monkeypatch, references, block_size=4)
    engine = batched.SpeculativeEngine(target, tiny_drafter(target, "markov", block_size=4), policy="all",
                                       keep_stats=True)
    outputs = run_staggered(engine, prompt_list, arrivals, max_new)
    assert sorted(outputs) == list(range(len(prompt_list)))
    for index, prompt in enumerate(prompt_list):
        assert torch.equal(outputs[index], references[index][: prompt.shape[1] + max_new[index]]), f"request {index}"
    assert sum(sum(s.accepted) for s in engine.stats.values()) > 0


def test_plain_engine_and_parked_turns_keep_the_window():
    """Without a drafter (one token per row per round), and a conversation's next turn continued on its parked
    cache (holes after the shorter parked row) next to a running prompt."""
    target = sliding_target("gemma3")
    first = prompts(3, length=5, seed=3)
    engine = batched.SpeculativeEngine(target)
    ids = [engine.submit(p[0], 6 + 3 * index, keep_cache=True) for index, p in enumerate(first[:2])]
    outputs = engine.run_until_done()
    for index, request in enumerate(ids):
        assert torch.equal(outputs[request], references_for(target, [first[index]], 6 + 3 * index)[0])
    parked = [engine.take_parked(r) for r in ids]
    follow_ups = [torch.cat([outputs[r], torch.tensor(extra)]) for r, extra in zip(ids, ([5, 9, 2], [7, 3, 8, 1, 4]))]
    running = engine.submit(first[2][0], 12)
    engine.step()
    resumed = [engine.submit(text, 10, resume=cache) for text, cache in zip(follow_ups, parked)]
    result = engine.run_until_done()
    for request, text in zip(resumed, follow_ups):
        assert torch.equal(result[request], references_for(target, [text[None]], 10)[0])
    assert torch.equal(result[running], references_for(target, [first[2]], 12)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_after_holes_are_each_rows_own(monkeypatch, family):
    """A random target's argmax barely moves with its window (Gemma 3's hardly at all); its logits do. After rounds
    that left holes at different places in each row, one more target step gives each row the logits of a plain
    forward over its own tokens."""
    target = sliding_target(family)
    prompt_list = prompts(3, length=5, seed=3)
    use_oracle(monkeypatch, references_for(target, prompt_list, 30), block_size=4)
    engine = batched.SpeculativeEngine(target, tiny_drafter(target, "markov", block_size=4), policy="all")
    for prompt in prompt_list:
        engine.submit(prompt[0], 24)
    for _ in range(4):
        engine.step()
    rows = engine._rows
    assert len(rows) == 3 and not bool(rows.target_valid.all())  # holes
    with torch.no_grad():
        logits = engine_rounds.plain_step(target, rows)  # each row's anchor (newest token) through the target
        for row, request in enumerate(rows.request_ids):
            tokens = torch.tensor(engine._requests[request].tokens)[None]
            assert int(rows.target_length[row]) == tokens.shape[1] > 3 * WINDOW
            torch.testing.assert_close(logits[row], target(tokens).logits[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen3"])
def test_a_slot_counted_window_changes_the_output(monkeypatch, family):
    """The engine before sliding targets ran (2D mask: transformers counts the window in cache slots, holes
    included), or a window left out, decodes these prompts differently: the tests above would catch either."""
    target = sliding_target(family)
    prompt_list = prompts(3, length=5, seed=3)
    references = references_for(target, prompt_list, MAX_NEW + 8)
    expected = [r[: p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)]
    monkeypatch.setattr(engine_rounds, "target_attention_mask", slot_counted)
    out = run_rigged(monkeypatch, target, prompt_list, references)
    assert any(not torch.equal(a, b) for a, b in zip(out.sequences, expected))
    monkeypatch.undo()
    kinds = mask_kinds(target)
    monkeypatch.setattr(engine_masks, "mask_kinds", lambda target_: MaskKinds(kinds.kinds, window=10**6))
    out = run_rigged(monkeypatch, target, prompt_list, references)
    assert any(not torch.equal(a, b) for a, b in zip(out.sequences, expected))


# ---------------------------------------------------------------------------------------------------------
# What still cannot run
# ---------------------------------------------------------------------------------------------------------


def as_target(config, base_model=None):
    config._attn_implementation = "sdpa"
    return SimpleNamespace(config=config, base_model=base_model)


def test_layer_kinds_the_engine_cannot_keep_are_refused_by_name():
    small = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 intermediate_size=64)
    # Recurrent layers beside full attention run (tests/lossless/test_hybrid_targets.py); beside sliding layers they do not.
    if keeps_states_per_position():
        hybrid = [type(layer).__name__ for layer in new_target_cache(as_target(Qwen3NextConfig(**small))).layers]
        assert hybrid == ["LinearAttentionLayer"] * 3 + ["GrowingLayer"]
    else:  # a release that keeps no per-position states (tests/lossless/test_hybrid_refusal.py)
        with pytest.raises(ValueError, match="transformers>=5.25.0"):
            new_target_cache(as_target(Qwen3NextConfig(**small)))
    sliding_hybrid = Qwen3_5TextConfig(layer_types=["linear_attention", "sliding_attention"] * 2,
                                       sliding_window=WINDOW, **small)
    with pytest.raises(ValueError, match="sliding-window layers.*per prompt"):
        new_target_cache(as_target(sliding_hybrid))
    with pytest.raises(ValueError, match="'chunked_attention'"):
        new_target_cache(as_target(Llama4TextConfig(attention_chunk_size=8, **small)))

    class BuildsItsOwnMask(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return attention_mask

    mixed = Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **small)
    with pytest.raises(ValueError, match="mixes full and sliding-window layers.*BuildsItsOwnMask"):
        new_target_cache(as_target(mixed, BuildsItsOwnMask()))
    everywhere = Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, **small)
    assert mask_kinds(as_target(everywhere, BuildsItsOwnMask())).window == WINDOW  # one mask for every layer
