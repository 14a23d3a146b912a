"""What keeping a hybrid target's recurrent / convolution state exact costs per speculative round.

A round verifies n tokens (the anchor and n - 1 drafts) in one target forward and accepts a of them (the anchor and
a - 1 drafts; the target's own next token is the next anchor, not yet in the cache). Attention layers drop the
rejected entries by cropping; a recurrent (gated DeltaNet) or convolution layer has one state that all n tokens went
into, so it must be brought back to its state after exactly the a accepted tokens. Options, each timed per round on
a prefilled cache (median of repeats, one thread):

* ``plain forward``: the verification forward alone, states left wrong: the floor every option is compared with.
* ``per-position states`` (C): transformers' own past recording (`cache.activate_past_recording(
  recurrent_states_to_keep=n)`): the verification forward keeps the state after each of its last n tokens (a gated
  DeltaNet layer runs those tokens through its one-token recurrent kernel instead of the chunked one; a convolution
  layer keeps its whole input window), and `cache.crop(a - n)` takes the state after token a.
* ``snapshot + replay`` (A): clone the states before the forward; when some token is rejected, put the clones back,
  crop the attention layers and run the a accepted tokens again (a second, shorter forward).
* ``fold replay into next`` (B): the same restore, but the a accepted tokens are run again at the front of the next
  round's verification forward (one forward of a + n tokens per round, no second forward). Timed as a lower bound:
  that forward does not keep the state after its replayed prefix either, so a real fold would replay everything
  since the last round that accepted all its tokens, or keep that one position's state (C's mechanism).

    OMP_NUM_THREADS=1 python benchmarks/hybrid_state_restore.py --output benchmarks/hybrid-state-restore/results.md

Reading (`benchmarks/hybrid-state-restore/results.md`, 2 shared CPU cores): C costs nothing measurable on the
real-width slices (-2..+3% over the bare forward; LFM2's convolutions only keep a longer window) and 28-30% on the
tiny Qwen3.5, where the one-token kernel's Python overhead per token and layer is all there is; A costs 40-100%
whenever a token is rejected (a second forward); B 4-18% as timed, more in truth (see above). hf_dspark uses C
(`hf_dspark/transformers_internals/recurrent_states.py`): no extra forward, no extra tokens, transformers' own bookkeeping, and
in the batched engine it gives every row its own accepted state from the one forward.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)
# A slice of a real-size model: the layer widths of a ~2B hybrid (Qwen3.5's 3:1 linear/full pattern; LFM2's
# conv-heavy pattern), 4 layers, a 32k vocabulary: the per-layer costs that decide between the options.
SMALL = dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4)


def qwen3_5(size: dict, tiny: bool):
    heads = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 head_dim=16) if tiny else dict(linear_num_key_heads=16, linear_num_value_heads=16,
                                                linear_key_head_dim=128, linear_value_head_dim=128, head_dim=128)
    config = Qwen3_5TextConfig(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                               **heads, **size)
    return Qwen3_5ForCausalLM(config).eval()


def lfm2(size: dict, tiny: bool):
    config = Lfm2Config(layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3, **size)
    return Lfm2ForCausalLM(config).eval()


def _linear_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def snapshot(cache):
    """Clones of every conv / recurrent state (the model updates them in place) and of the token count."""
    return [({i: s.clone() for i, s in layer.conv_states.items() if s is not None},
             {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
             layer.cumulative_length_linear.clone()) for layer in _linear_layers(cache)]


def restore(cache, saved, attention_tokens: int) -> None:
    for layer, (conv, recurrent, count) in zip(_linear_layers(cache), saved):
        for i, state in conv.items():
            layer.conv_states[i].copy_(state)
        for i, state in recurrent.items():
            layer.recurrent_states[i].copy_(state)
        layer.cumulative_length_linear.copy_(count)
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-attention_tokens)


def forward(model, cache, tokens):
    return model(input_ids=tokens, cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=0)


def plain_forward(model, cache, tokens, accepted):
    forward(model, cache, tokens)


def per_position_states(model, cache, tokens, accepted):
    forward(model, cache, tokens)
    cache.crop(accepted - tokens.shape[1])  # crop(0) too: it trims the recorded windows


def snapshot_replay(model, cache, tokens, accepted):
    saved = snapshot(cache)
    forward(model, cache, tokens)
    if accepted < tokens.shape[1]:
        restore(cache, saved, tokens.shape[1])
        forward(model, cache, tokens[:, :accepted])


def fold_into_next(model, cache, tokens, accepted):
    """A round in the steady state where each round accepts `accepted`: the previous round's accepted tokens run
    again at the front of this round's forward."""
    if accepted == tokens.shape[1]:  # nothing was rejected: the state after the forward is the one wanted
        forward(model, cache, tokens)
        return
    saved = snapshot(cache)
    forward(model, cache, torch.cat([tokens[:, :accepted], tokens], dim=1))
    restore(cache, saved, accepted + tokens.shape[1])


OPTIONS = {"plain forward (states wrong)": plain_forward, "per-position states (C)": per_position_states,
           "snapshot + replay (A)": snapshot_replay, "fold replay into next (B)": fold_into_next}


def prefilled(model, prompt_length: int, recording: int | None):
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(2, model.config.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    forward(model, cache, prompt)
    if recording is not None:
        cache.activate_past_recording(recurrent_states_to_keep=recording)
        cache.crop(0)
    return cache


@torch.no_grad()
def time_options(model, n: int, accepted: int, repeats: int) -> dict[str, tuple[float, float]]:
    """(Median, fastest) milliseconds of one round of each option, each on a fresh copy of a prefilled cache. The
    options take turns within every repeat, so a load that drifts during the run weighs on all of them alike."""
    bases = {label: prefilled(model, 48, n if option is per_position_states else None)
             for label, option in OPTIONS.items()}
    tokens = torch.randint(2, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    times = {label: [] for label in OPTIONS}
    for index in range(repeats + 1):
        for label, option in OPTIONS.items():
            cache = copy.deepcopy(bases[label])
            started = time.perf_counter()
            option(model, cache, tokens, accepted)
            if index:  # the first round of each is a warm-up
                times[label].append(time.perf_counter() - started)
    return {label: (1000 * statistics.median(values), 1000 * min(values)) for label, values in times.items()}


def table(name: str, model, n: int, repeats: int) -> list[str]:
    accepted_counts = sorted({1, (n + 1) // 2, n})
    columns = [time_options(model, n, a, repeats) for a in accepted_counts]
    lines = [f"## {name}: verification of n = {n} tokens, a accepted; ms per round: fastest (median) of {repeats}, "
             "and the fastest over the plain forward's fastest (the machine is shared: the fastest is the steadier)",
             "",
             "| option | " + " | ".join(f"a = {a}" for a in accepted_counts) + " |",
             "|---|" + "---:|" * len(accepted_counts)]
    floor = next(iter(OPTIONS))
    for label in OPTIONS:
        cells = [f"{column[label][1]:.2f} ({column[label][0]:.2f}) {column[label][1] / column[floor][1] - 1:+.0%}"
                 for column in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--small-repeats", type=int, default=5)
    parser.add_argument("--skip-small", action="store_true", help="only the tiny targets")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [f"# command: OMP_NUM_THREADS={torch.get_num_threads()} python benchmarks/hybrid_state_restore.py",
             f"# machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
             f"torch {torch.__version__}, transformers {transformers.__version__}, fp32, reference (PyTorch) "
             "kernels for the gated delta rule and the causal convolution", ""]
    runs = [("tiny Qwen3.5 (3 gated DeltaNet + 1 attention, hidden 64)", qwen3_5(TINY, True), 5, args.repeats),
            ("tiny LFM2 (3 short conv + 1 attention, hidden 64)", lfm2(TINY, True), 5, args.repeats)]
    if not args.skip_small:
        runs += [("small Qwen3.5 slice (hidden 2048, 16 linear heads of 128, 4 layers)", qwen3_5(SMALL, False), 8,
                  args.small_repeats),
                 ("small LFM2 slice (hidden 2048, 4 layers)", lfm2(SMALL, False), 8, args.small_repeats)]
    for name, model, n, repeats in runs:
        lines += table(name, model, n, repeats)
        print("\n".join(lines[-(len(OPTIONS) + 5):]), flush=True)
        del model
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
