"""Hybrid targets (recurrent or convolution layers beside attention: Qwen3.5's gated DeltaNet, LFM2's short
convolutions) stay exact under speculative decoding: after a round accepts k of n drafts, each such layer's state is
its state after exactly the accepted tokens. Greedy output equals plain `generate` for every drafter kind with zero,
some and all drafts accepted and EOS inside a block; sampling follows the target's distribution."""

from collections import Counter

import pytest
import torch
from transformers import (LogitsProcessorList, NemotronHConfig, NemotronHForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM, TemperatureLogitsWarper, TopPLogitsWarper, TrainingArguments)

import hf_dspark.generation.engine.passes as passes
import hf_dspark.generation.engine.speculative_engine as engine_module
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.generation.engine.eagle3 import row_drafter_for
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows
from hf_dspark.transformers_internals.recurrent_states import keeps_states_per_position, state_problems
from hf_dspark.policy import VerificationCostTable
from hf_dspark.training import DSparkTrainer
from hf_dspark.training.init import init_context_from_target, init_layers_from_target
from hf_dspark.training.trainer import frozen_target_states
from factories import VOCAB, prompts, tiny_drafter, tiny_target
from lossless_checks import assert_three_tokens_match
from batch_helpers import MAX_NEW, assert_rows_equal, left_pad
from lossless_checks import TINY_VOCAB

# Releases before 5.25.0 keep no per-position states: there hybrid targets are refused before any forward
# (tests/lossless/test_hybrid_refusal.py), and what this module checks does not run.
pytestmark = pytest.mark.skipif(not keeps_states_per_position(),
                                reason="this transformers release keeps no per-position recurrent states")
HYBRIDS = ["qwen3_5", "lfm2"]
KINDS = ["markov", "dflash", "eagle3"]  # markov: DSpark with its Markov head and confidence head
BLOCK = 4


def plain_greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


def drafter_for(target, kind: str, block_size: int = BLOCK):
    drafter = tiny_drafter(target, kind, block_size=block_size)
    drafter.generation_config.dspark_round_planning = False  # every round drafts (what the oracle rigs)
    return drafter


def rig_drafts(monkeypatch, reference: torch.Tensor, schedule) -> None:
    """Replace each round's drafts by the target's own greedy continuation (from `reference`, (1, L)), corrupted from
    slot `schedule(round)` on (None: none corrupted), so rounds accept zero, some or all of their drafts. The drafter
    still runs; only its tokens are replaced (greedy verification compares tokens)."""
    original = OnePromptRows.draft
    rounds = iter(range(10**6))

    def draft(self, budget, *args):
        drafts = original(self, budget, *args)
        correct = schedule(next(rounds))
        start = self.sequence.shape[1]
        for slot in range(int(budget[0])):
            token = int(reference[0, start + slot]) if start + slot < reference.shape[1] else 0
            wrong = correct is not None and slot >= correct
            drafts.tokens[0, slot] = (token + 1) % VOCAB if wrong else token
        return drafts

    monkeypatch.setattr(OnePromptRows, "draft", draft)


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_random_drafter_matches_plain_greedy(family, kind):
    target = tiny_target(family)
    drafter = drafter_for(target, kind)
    for ids in prompts(3):
        expected = plain_greedy(target, ids, max_new_tokens=20)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20)
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_some_and_all_drafts_accepted(monkeypatch, family, kind):
    target = tiny_target(family)
    drafter = drafter_for(target, kind)
    ids = prompts(1)[0]
    reference = plain_greedy(target, ids, max_new_tokens=60)
    # Round r keeps its first (r mod 6) drafts: 0, 1, 2, 3, then all of them (4 and 5 with a block of 4 slots).
    rig_drafts(monkeypatch, reference, lambda r: r % (BLOCK + 2))
    actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40)
    assert torch.equal(actual, reference[:, : ids.shape[1] + 40])
    stats = drafter.last_generation_stats
    full = [a for a, d in zip(stats.accepted, stats.draft_lengths) if d == BLOCK]
    assert {0, 1, 2, BLOCK} <= set(full), Counter(zip(stats.draft_lengths, stats.accepted))


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_eos_and_length_limit_inside_a_block(monkeypatch, family, kind):
    target = tiny_target(family)
    drafter = drafter_for(target, kind, block_size=6)
    ids = prompts(1)[0]
    reference = plain_greedy(target, ids, max_new_tokens=40)
    rig_drafts(monkeypatch, reference, lambda r: None)  # all accepted: blocks run past EOS and the limit
    new_tokens = reference[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new_tokens) if i >= 3 and t not in new_tokens[:i])
    expected = plain_greedy(target, ids, max_new_tokens=40, eos_token_id=eos)
    assert int(expected[0, -1]) == eos and expected.shape[1] < reference.shape[1]
    actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(actual, expected)
    for limit in (1, 2, 5, 9):
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=limit),
                           plain_greedy(target, ids, max_new_tokens=limit))


@pytest.mark.parametrize("family", HYBRIDS)
def test_verification_padded_to_a_cheaper_size_stays_exact(monkeypatch, family):
    """A cost table pads verifications with dummy tokens after the real ones: they go into the recurrent states
    too, and are dropped with the rejected drafts."""
    table = VerificationCostTable([1.0, 3.0, 3.0, 3.0, 1.2, 5.0])
    target = tiny_target(family)
    drafter = drafter_for(target, "markov")
    drafter.generation_config.update(dspark_cost_table=table, dspark_learn_round_costs=False)
    ids = prompts(1)[0]
    reference = plain_greedy(target, ids, max_new_tokens=40)
    rig_drafts(monkeypatch, reference, lambda r: r % (BLOCK + 2))
    sizes = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)
    try:
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24)
    finally:
        hook.remove()
    assert torch.equal(actual, reference[:, : ids.shape[1] + 24])
    lengths = drafter.last_generation_stats.draft_lengths
    assert any(size > length + 1 for size, length in zip(sizes[1:], lengths))  # some forwards were padded


@pytest.mark.parametrize("family", HYBRIDS)
def test_returned_cache_holds_the_state_after_the_output(monkeypatch, family):
    """The cache `generate` returns continues the text exactly: its recurrent states are those after the output but
    its newest token (not of a rejected draft), and it keeps only the newest states again."""
    target = tiny_target(family)
    drafter = drafter_for(target, "markov")
    ids = prompts(1)[0]
    reference = plain_greedy(target, ids, max_new_tokens=40)
    rig_drafts(monkeypatch, reference, lambda r: r % 3)  # every round rejects some drafts
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=17,
                          return_dict_in_generate=True)
    sequence = out.sequences
    assert torch.equal(sequence, reference[:, : ids.shape[1] + 17])
    assert not any(getattr(layer, "record_past", False) for layer in out.cache.layers)
    with torch.no_grad():
        continued = target(input_ids=sequence[:, -1:], cache=out.cache, use_cache=True).logits[0, -1]
        whole = target(input_ids=sequence).logits[0, -1]
    torch.testing.assert_close(continued, whole, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# R > 1: the batched engine (each row accepts its own count; padding and rejected drafts stay out of the states)
# ---------------------------------------------------------------------------------------------------------


def rig_engine_drafts(monkeypatch, references: list[torch.Tensor], block_size: int) -> None:
    """The engine's drafting pass (every drafter kind) with each row's drafts replaced by its request's greedy
    continuation, corrupted from a slot that varies by row and round (all kept for some)."""
    rounds = iter(range(10**6))

    def wrap(drafting_pass):
        def oracle(drafter, rows, budget, *args):
            drafts = drafting_pass(drafter, rows, budget, *args)
            round_index = next(rounds)
            for row, request in enumerate(rows.request.tolist()):
                start = int(rows.target_length[row]) + 1  # the anchor sits at target_length
                correct = (request + round_index) % (block_size + 2)
                for slot in range(int(drafts.lengths[row])):
                    token = int(references[request][start + slot])
                    drafts.tokens[row, slot] = token if slot < correct else (token + 1) % VOCAB
            return drafts
        return oracle

    monkeypatch.setattr(engine_module, "row_drafter_for",
                        lambda drafter: wrap(row_drafter_for(drafter) or engine_module._draft))


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_rows_match_plain_greedy(monkeypatch, family, kind):
    target = tiny_target(family)
    drafter = drafter_for(target, kind)
    prompt_list = prompts(4)  # lengths 6, 7, 8, 6: left padding enters the prefill
    references = [plain_greedy(target, p, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    rig_engine_drafts(monkeypatch, references, BLOCK)
    out = batched_speculative_generate(target, drafter, *left_pad(prompt_list), max_new_tokens=MAX_NEW)
    assert_rows_equal(out, [r[: p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)])
    accepted = {a for stats in out.stats for a, d in zip(stats.accepted, stats.draft_lengths) if d == BLOCK}
    assert {0, 1, BLOCK} <= accepted, accepted
    # generate() routes a left-padded batch to the same engine
    ids, mask = left_pad(prompt_list)
    sequences = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                max_new_tokens=MAX_NEW)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(sequences, plain)


@pytest.mark.parametrize("family", HYBRIDS)
def test_engine_rows_stop_at_eos_inside_a_block(monkeypatch, family):
    target = tiny_target(family)
    drafter = drafter_for(target, "markov")
    prompt_list = prompts(4)
    free = [plain_greedy(target, p, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    new = free[1][prompt_list[1].shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if 3 <= i < MAX_NEW - 2 and t not in new[:i])
    expected = [plain_greedy(target, p, max_new_tokens=MAX_NEW, eos_token_id=eos)[0] for p in prompt_list]
    assert any(e.shape[0] < f.shape[0] for e, f in zip(expected, free))
    references = [plain_greedy(target, p, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    rig_engine_drafts(monkeypatch, references, BLOCK)
    out = batched_speculative_generate(target, drafter, *left_pad(prompt_list), max_new_tokens=MAX_NEW,
                                       eos_token_id=eos)
    assert_rows_equal(out, expected)


@pytest.mark.parametrize("family", HYBRIDS)
def test_engine_requests_join_and_leave(monkeypatch, family):
    """Continuous batching: rows join a running batch (their states stacked after the others') and leave it (their
    states dropped), each request still its own plain greedy output; parking a hybrid cache is refused."""
    target = tiny_target(family)
    drafter = drafter_for(target, "markov")
    prompt_list = prompts(5)
    references = [plain_greedy(target, p, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    rig_engine_drafts(monkeypatch, references, BLOCK)
    engine = SpeculativeEngine(target, drafter)
    limits = [MAX_NEW, 5, MAX_NEW, 9, 7]
    ids = [engine.submit(prompt_list[i][0], max_new_tokens=limits[i]) for i in (0, 1)]
    outputs = engine.step()
    ids += [engine.submit(prompt_list[i][0], max_new_tokens=limits[i]) for i in (2, 3)]
    outputs.update(engine.step())
    ids.append(engine.submit(prompt_list[4][0], max_new_tokens=limits[4]))
    outputs.update(engine.run_until_done())
    for request, prompt, limit, reference in zip(ids, prompt_list, limits, references):
        assert torch.equal(outputs[request], reference[: prompt.shape[1] + limit])
    with pytest.raises(ValueError, match="recurrent, convolution or KV-shared layers"):
        SpeculativeEngine(target).submit(prompt_list[0][0], max_new_tokens=3, keep_cache=True)


@pytest.mark.parametrize("family", HYBRIDS)
def test_engine_failing_round_is_undone_and_plain_decoding(monkeypatch, family):
    """A round that raises after its verification forward (the recurrent states already written in place) leaves
    the engine as before it; the next steps decode exactly. Plain continuous batching (no drafter) too."""
    target = tiny_target(family)
    drafter = drafter_for(target, "markov")
    prompt_list = prompts(3)
    references = [plain_greedy(target, p, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    rig_engine_drafts(monkeypatch, references, BLOCK)
    engine = SpeculativeEngine(target, drafter)
    ids = [engine.submit(p[0], max_new_tokens=MAX_NEW) for p in prompt_list]
    engine.step()
    original, calls = passes.target_forward, []

    def failing_forward(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure")
        return out

    monkeypatch.setattr(passes, "target_forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated failure"):
        engine.step()
    outputs = engine.run_until_done()
    for request, prompt, reference in zip(ids, prompt_list, references):
        assert torch.equal(outputs[request], reference[: prompt.shape[1] + MAX_NEW])
    plain = SpeculativeEngine(target)
    ids = [plain.submit(p[0], max_new_tokens=MAX_NEW) for p in prompt_list]
    outputs = plain.run_until_done()
    for request, prompt, reference in zip(ids, prompt_list, references):
        assert torch.equal(outputs[request], reference[: prompt.shape[1] + MAX_NEW])


def other_hybrid(family: str):
    """Tiny Qwen3-Next (gated DeltaNet + attention, MoE) and Nemotron-H (Mamba-2 + attention + MLP-only layers)."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                  initializer_range=0.2)
    if family == "qwen3_next":
        config = Qwen3NextConfig(
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, **common)
        return Qwen3NextForCausalLM(config).eval()
    config = NemotronHConfig(layers_block_type=["mamba", "attention", "mamba", "mlp"], intermediate_size=128,
                             mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_d_conv=4,
                             expand=1, **common)
    return NemotronHForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_qwen3_next_and_nemotron_h(monkeypatch, family):
    """The same mechanism covers Qwen3-Next's gated DeltaNet and Nemotron-H's Mamba-2 layers, at batch 1 and R > 1."""
    target = other_hybrid(family)
    drafter = drafter_for(target, "markov")
    prompt_list = prompts(3)
    references = [plain_greedy(target, p, max_new_tokens=MAX_NEW + 8) for p in prompt_list]
    rig_drafts(monkeypatch, references[0], lambda r: r % (BLOCK + 2))
    actual = target.generate(prompt_list[0], assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW)
    assert torch.equal(actual, references[0][:, : prompt_list[0].shape[1] + MAX_NEW])
    assert {0, BLOCK} <= set(drafter.last_generation_stats.accepted)
    rig_engine_drafts(monkeypatch, [r[0] for r in references], BLOCK)
    out = batched_speculative_generate(target, drafter, *left_pad(prompt_list), max_new_tokens=MAX_NEW)
    assert_rows_equal(out, [r[0, : p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)])


# ---------------------------------------------------------------------------------------------------------
# Sampling: the tokens after a partly accepted round follow the target's distribution
# ---------------------------------------------------------------------------------------------------------


def exact_joint(target, ids, temperature: float, top_p: float, length: int) -> torch.Tensor:
    """P(x1, ..., x_length) of plain sampling with the same warpers, from the target's logits (full forwards)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    joint = torch.zeros((TINY_VOCAB,) * length)
    with torch.no_grad():
        def extend(prefix, probability, tokens):
            if len(tokens) == length:
                joint[tuple(tokens)] = probability
                return
            probs = warpers(prefix, target(prefix).logits[:, -1]).softmax(-1)[0]
            for token in range(TINY_VOCAB):
                if probs[token] > 0:
                    extend(torch.cat([prefix, prefix.new_tensor([[token]])], dim=-1), probability * probs[token],
                           tokens + [token])
        extend(ids, 1.0, [])
    return joint


def sampling_target(family: str):
    return tiny_target(family, vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)


@pytest.mark.slow  # a sampling-distribution test
@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "engine"])
def test_sampling_matches_target_distribution(family, batched):
    """Four new tokens with one draft per round: x1 from the prefill, x2 drafted (accepted or resampled), x3 and x4
    from rounds that follow an accepted or a rejected draft, so they read the recurrent states a round left. The
    counts of (x2, x3, x4) follow the target's joint; a double-temperature sampler would be rejected."""
    target = sampling_target(family)
    drafter = tiny_drafter(target, "markov", block_size=2)
    drafter.generation_config.dspark_round_planning = False
    ids = torch.tensor([[1, 4, 2, 5]])
    temperature, top_p = 0.7, 0.9
    joint = exact_joint(target, ids, temperature, top_p, 4).sum(0)
    biased = exact_joint(target, ids, temperature * temperature, top_p, 4).sum(0)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    accepted = Counter()
    torch.manual_seed(2024)
    generator = torch.Generator().manual_seed(2024)
    samples, batch = 2400, 60
    for _ in range(samples // batch if batched else samples):
        if batched:
            out = batched_speculative_generate(target, drafter, ids.repeat(batch, 1), torch.ones(batch, 4),
                                               max_new_tokens=4, do_sample=True, temperature=temperature,
                                               top_p=top_p, generator=generator)
            rows, stats = [s[-3:].tolist() for s in out.sequences], out.stats
        else:
            out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature,
                                  top_p=top_p, top_k=0, max_new_tokens=4)
            rows, stats = [out[0, -3:].tolist()], [drafter.last_generation_stats]
        for (x2, x3, x4), row_stats in zip(rows, stats):
            counts[x2, x3, x4] += 1
            accepted.update(row_stats.accepted[:1])
    assert accepted[0] > 0.05 * samples and accepted[1] > 0.05 * samples  # both paths ran before x3 / x4
    assert_three_tokens_match(counts, joint, biased, samples)


# ---------------------------------------------------------------------------------------------------------
# Training drafters for hybrid targets
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", HYBRIDS)
def test_training_reads_features_and_copies_layers_of_hybrid_targets(tmp_path, family):
    """Target features of a right-padded batch are those of each example alone (padding after an example cannot
    reach its recurrent states); a few training steps run for every drafter kind; layers and the context norm
    copied from the target act as the target's (Qwen3.5 stores its norms as w - 1, LFM2 names them its own way)."""
    target = tiny_target(family)
    drafter = tiny_drafter(target, "markov", block_size=BLOCK)
    indices, final = drafter.target_hidden_state_indices, target.config.num_hidden_layers
    long, short = prompts(1, length=12)[0], prompts(1, length=7, seed=5)[0]
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[0], ids[1, :7] = long[0], short[0]
    mask = (torch.arange(12)[None] < torch.tensor([[12], [7]])).long()
    batch_features, _ = frozen_target_states(target, ids, mask, indices, final)
    alone, _ = frozen_target_states(target, short, torch.ones_like(short), indices, final)
    torch.testing.assert_close(batch_features[1, :7], alone[0], rtol=1e-5, atol=1e-5)

    examples = [{"input_ids": plain_greedy(target, p, max_new_tokens=16)[0].tolist(),
                 "loss_mask": [0] * p.shape[1] + [1] * 16} for p in prompts(4, seed=7)]
    for kind in KINDS:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                 learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, logging_steps=1)
        trainer = DSparkTrainer(model=tiny_drafter(target, kind, block_size=BLOCK), target=target, args=args,
                                train_dataset=examples, num_anchors=4)
        trainer.train()
        assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)

    attention = next(i for i, kind in enumerate(target.config.layer_types) if kind == "full_attention")
    assert init_layers_from_target(drafter, target, [attention])
    init_context_from_target(drafter, target, 2)  # target layer 1 is fused (target_layer_ids)
    states = torch.randn(3, target.config.hidden_size)
    layer = target.model.layers[attention]
    norm = layer.input_layernorm if family == "qwen3_5" else layer.operator_norm
    torch.testing.assert_close(drafter.layers[0].input_layernorm(states), norm(states), rtol=1e-4, atol=1e-4)


def test_static_cache_is_refused_for_a_hybrid_target():
    target = tiny_target("qwen3_5")
    with pytest.raises(ValueError, match="linear_attention.*default dynamic cache"):
        target.generate(prompts(1)[0], assistant_model=drafter_for(target, "markov"), do_sample=False,
                        max_new_tokens=4, cache_implementation="static")


@pytest.mark.parametrize("family", HYBRIDS)
def test_transformers_keeps_the_states_relied_on(family):
    """The pin of `recurrent_states`: the installed transformers still keeps per-position states as relied on."""
    assert state_problems(tiny_target(family)) == []
