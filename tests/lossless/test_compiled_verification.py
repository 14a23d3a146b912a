"""Compiled verification at batch 1: `generate(..., assistant_model=drafter, cache_implementation="static")`.

The target's verification forwards go through its compiled call (`get_compiled_call(compile_config)`), padded to a
few bucket lengths. On CPU stock `generate` compiles only when the compile config says `_compile_all_devices`, so
these tests do too. Inductor needs about a minute per shape on this CPU, so the compile backend here is a recorder:
dynamo captures the graph exactly as for inductor, and the recorder runs the captured graph as is while counting the
shapes it was captured for and the calls; one test runs torch's `aot_eager` backend (functionalised in-place cache
writes, the step before inductor's code generation) on a single shape. `benchmarks/compiled_verification.py` runs
inductor itself.
"""


import pytest
import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from hf_dspark.generation.one_prompt.target_runners import (DynamicTargetRunner, StaticTargetRunner, target_runner_for,
                                                 verification_buckets)
from hf_dspark import DraftingState
from hf_dspark.policy import VerificationCostTable
from factories import prompts, tiny_drafter, tiny_target

# A small vocabulary makes random drafters and suffix proposals right often enough that rounds accept 0 to all drafts.
SMALL_VOCAB = 8
NEW_TOKENS = 24
BLOCK_SIZE = 4
# Forward seconds for 1..5 tokens: padding 2 -> 3 and 4 -> 5 is cheaper, so the cost rule's buckets are (1, 3, 5),
# not the power-of-two rule's (1, 2, 4, 5).
COSTS = VerificationCostTable([1.0, 1.6, 1.5, 2.2, 2.1])


class GraphRecorder:
    """A `torch.compile` backend that runs each captured graph unchanged and records the `input_ids` length it was
    captured for, and how many times captured graphs ran."""

    def __init__(self):
        self.lengths: list[int] = []
        self.calls = 0

    def __call__(self, graph_module, example_inputs):
        placeholders = [node.name for node in graph_module.graph.find_nodes(op="placeholder")]
        (tokens,) = [x for name, x in zip(placeholders, example_inputs) if "input_ids" in name]
        self.lengths.append(tokens.shape[1])

        def run(*args):
            self.calls += 1
            return graph_module.forward(*args)

        return run

    def __deepcopy__(self, memo):
        return self  # `CompileConfig.to_dict()` deep-copies its backend; the counts must stay in this one


def compile_all_devices(config: CompileConfig) -> CompileConfig:
    config._compile_all_devices = True  # stock generate's switch for compiling on CPU
    return config


@pytest.fixture(scope="module")
def recorder():
    # Every model's forward shares one dynamo code object (transformers' deprecation wrapper), so all graphs of this
    # module count against one recompile limit; past it dynamo would silently run eagerly.
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        yield GraphRecorder()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def compile_config(recorder):
    return compile_all_devices(CompileConfig(backend=recorder, dynamic=False, mode="default"))


@pytest.fixture(scope="module")
def targets():
    """One target per family for the whole module: its compiled call and graphs are reused across tests."""
    return {family: tiny_target(family, vocab_size=SMALL_VOCAB) for family in ("llama", "qwen3", "gemma3")}


def static_generate(target, ids, drafter, compile_config, **kwargs):
    return target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, cache_implementation="static",
                           compile_config=compile_config, **kwargs)


def test_bucket_rules_cover_every_round():
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    for block_size in (1, 3, 4, 7):
        drafter = tiny_drafter(target, "markov", block_size=block_size)
        buckets = verification_buckets(drafter.config.num_draft_slots)
        most = block_size + 1
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == most
        assert all(b & (b - 1) == 0 for b in buckets[:-1])  # powers of two below the largest round
        assert all(any(n <= b < 2 * n for b in buckets) for n in range(1, most + 1))  # never more than doubled
        assert verification_buckets(drafter.config.num_draft_slots, COSTS) == tuple(
            sorted({COSTS.padded_tokens(n) for n in range(1, most + 1)}))
    assert verification_buckets(drafter.config.num_draft_slots, COSTS) != (1, 2, 4, 8)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["markov", "eagle3"])
@pytest.mark.parametrize("with_costs", [False, True], ids=["powers-of-two", "cost-table"])
def test_compiled_verification_matches_plain_greedy(targets, recorder, compile_config,
                                                    family, kind, with_costs):
    target = targets[family]
    drafter = tiny_drafter(target, kind, block_size=BLOCK_SIZE)
    costs = COSTS if with_costs else None
    # The synthetic table is the truth here: costs timed in the loop would follow this machine's load (under heavy
    # load they priced drafting out and no round was rejected).
    drafter.generation_config.update(dspark_suffix_drafting=True, dspark_cost_table=costs,
                                     dspark_learn_round_costs=False)
    graphs_before, calls_before, rounds, accepted = len(recorder.lengths), recorder.calls, 0, []
    with_logits = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    state = DraftingState()  # the planner learns over the three prompts
    for ids in prompts(3, vocab_size=SMALL_VOCAB):  # three prompt lengths: one cache length, no recompiles
        expected = target.generate(ids, max_new_tokens=NEW_TOKENS, **with_logits)
        actual = static_generate(target, ids, drafter, compile_config, dspark_state=state, **with_logits)
        assert torch.equal(actual.sequences, expected.sequences)
        torch.testing.assert_close(torch.cat(actual.logits), torch.cat(expected.logits), rtol=1e-4, atol=1e-4)
        stats = drafter.last_generation_stats
        rounds += stats.num_rounds
        accepted += [a for a, d in zip(stats.accepted, stats.draft_lengths) if d > 0]
    new_graphs = recorder.lengths[graphs_before:]
    buckets = verification_buckets(drafter.config.num_draft_slots, costs)
    assert set(new_graphs) <= set(buckets)  # every compiled shape is a bucket ...
    assert len(new_graphs) == len(set(new_graphs))  # ... compiled once for all three prompts
    assert recorder.calls - calls_before == rounds  # every verification ran through the compiled forward
    assert 0 in accepted and max(accepted) >= 1  # rejected drafts cropped; accepted ones commit several tokens


def test_sliding_window_target_keeps_its_window(targets, recorder, compile_config):
    target = targets["gemma3"]
    window = target.config.sliding_window
    drafter = tiny_drafter(target, "markov", block_size=BLOCK_SIZE)
    drafter.generation_config.dspark_suffix_drafting = True
    calls_before = recorder.calls
    with_logits = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    state = DraftingState()  # the planner learns over both prompts
    for ids in prompts(2, vocab_size=SMALL_VOCAB):
        expected = target.generate(ids, max_new_tokens=NEW_TOKENS, **with_logits)
        output = static_generate(target, ids, drafter, compile_config, dspark_state=state, **with_logits)
        assert output.sequences.shape[1] > 3 * window  # rounds crop long after the window filled
        assert torch.equal(output.sequences, expected.sequences)
        # Logits too: a wrong window would barely move a random target's argmax, but it moves its logits.
        torch.testing.assert_close(torch.cat(output.logits), torch.cat(expected.logits), rtol=1e-4, atol=1e-4)
        # The returned cache is generate's own, its static sliding-window layers made full-length (they cannot undo a
        # crop once their window has moved on); the mask still applies the window.
        assert all(type(layer) is StaticLayer for layer in output.cache.layers)
    assert recorder.calls > calls_before


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_sampling_draws_what_the_eager_loop_draws(targets, compile_config, kind):
    """The runner consumes no randomness, so with the same seed the compiled path must draw the very tokens of the
    eager path, whose distribution tests/lossless/test_sampling_lossless.py checks."""
    target = targets["llama"]
    drafter = tiny_drafter(target, kind, block_size=BLOCK_SIZE)
    drafter.generation_config.dspark_learn_round_costs = False  # flat prices: both paths plan the same rounds
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.95)
    accepted = 0
    for seed, ids in enumerate(prompts(2, vocab_size=SMALL_VOCAB) * 2):
        # Each call from a fresh state: what an earlier call measured (its drafter's acceptance) changes the plans.
        torch.manual_seed(seed)
        eager = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, dspark_state=DraftingState(),
                                **sampling)
        torch.manual_seed(seed)
        compiled = static_generate(target, ids, drafter, compile_config, dspark_state=DraftingState(), **sampling)
        assert torch.equal(compiled, eager)
        accepted += sum(drafter.last_generation_stats.accepted)
    assert accepted > 0


def test_runner_outputs_match_the_dynamic_runner(targets, compile_config):
    """The contract itself: prefill, padded verifications and crops give the dynamic runner's hidden states and
    logits, the padding cut off."""
    target = targets["qwen3"]
    layer_indices = [1, 3, 4]  # 4: the last layer's output after the final norm
    dynamic = DynamicTargetRunner(target, DynamicCache(config=target.config), layer_indices)
    compiled = target.get_compiled_call(compile_config)
    static = StaticTargetRunner(target, StaticCache(config=target.config, max_cache_len=64), layer_indices,
                                capacity=64, buckets=(2, 4, 8), compiled_forward=compiled)
    tokens = torch.randint(0, SMALL_VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    # (tokens already cached, tokens in this forward); each forward is followed by a crop, as in the loop
    schedule = [(0, 9), (9, 3), (10, 5), (14, 1), (12, 7), (18, 3)]
    with torch.no_grad():
        for start, count in schedule:
            dynamic.crop(start)
            static.crop(start)
            keep = 1 if start == 0 else count
            (d_out, d_logits), (s_out, s_logits) = (runner.forward(tokens[:, start : start + count], keep)
                                                    for runner in (dynamic, static))
            assert s_logits.shape == d_logits.shape == (1, keep, SMALL_VOCAB)
            torch.testing.assert_close(s_logits, d_logits, rtol=1e-4, atol=1e-4)
            for i in layer_indices:
                assert s_out.hidden_states[i].shape[1] == count
                torch.testing.assert_close(s_out.hidden_states[i], d_out.hidden_states[i], rtol=1e-4, atol=1e-4)
    assert static.compiled_lengths == {4, 8, 2}  # 3 and 5 padded, 1 padded to the smallest bucket, 7 to 8
    assert int(static.cache.get_seq_length()) == static.length == 21


def test_aot_eager_backend_single_bucket():
    """torch's aot_eager backend (what inductor compiles from) on one shape: a cost table that makes every round
    cheapest at the largest size pads all of them to it."""
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, "markov", block_size=BLOCK_SIZE)
    drafter.generation_config.dspark_cost_table = VerificationCostTable([2.0, 2.0, 2.0, 2.0, 1.0])
    assert verification_buckets(drafter.config.num_draft_slots, drafter.generation_config.dspark_cost_table) == (
        BLOCK_SIZE + 1,)
    config = compile_all_devices(CompileConfig(backend="aot_eager", dynamic=False, mode="default"))
    with torch._dynamo.config.patch(recompile_limit=64):
        for ids in prompts(2, vocab_size=SMALL_VOCAB):
            expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
            assert torch.equal(static_generate(target, ids, drafter, config, do_sample=False), expected)
    assert target._last_compile_config is config  # generate's own compiled call, made from our config


def test_static_cache_without_compiling_runs_eagerly(targets, recorder, compile_config):
    """As in stock generate: a static cache on CPU without `_compile_all_devices`, or `disable_compile=True`,
    compiles nothing; the output is still plain greedy's."""
    target = targets["llama"]
    drafter = tiny_drafter(target, "markov", block_size=BLOCK_SIZE)
    calls_before = recorder.calls
    for ids in prompts(2, vocab_size=SMALL_VOCAB):
        expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
        assert torch.equal(static_generate(target, ids, drafter, None, do_sample=False), expected)
        assert torch.equal(static_generate(target, ids, drafter, compile_config, do_sample=False,
                                           disable_compile=True), expected)
    assert recorder.calls == calls_before


def test_unsupported_static_caches_are_refused_before_decoding():
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, "markov", block_size=BLOCK_SIZE)
    ids = prompts(1, vocab_size=SMALL_VOCAB)[0]
    with pytest.raises(ValueError, match="offloaded_static.*cache_implementation='static'"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, cache_implementation="offloaded_static")
    odd = StaticCache(config=target.config, max_cache_len=64)
    odd.layers[1] = DynamicLayer()  # e.g. a cache put together by hand
    with pytest.raises(ValueError, match="full and sliding-window attention layers.*Drop cache_implementation"):
        target_runner_for(target, odd, GenerationConfig(max_length=32), [1], drafter.config.num_draft_slots)
