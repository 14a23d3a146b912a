"""How draft and target tokens are picked: the user's processors, applied exactly once per slot, and the sampler.

Two choosers share one interface (`process`, `choose`, `any_sampled`, `all_sampled`, `sampled_rows`), so the one
drafting core (`drafting.draft_block`) and the one verification call (`verification.verify_drafts`) serve both loops:

* `ProcessorSampling` (batch 1): `generate`'s own `LogitsProcessorList`, with each slot's full context (prompt,
  text so far and the drafts before the slot) for processors that read it, e.g. a repetition penalty;
* `RowSampling` (the batched engine): each row's `SamplingParams` (temperature, top-k, top-p: context-free
  warpers), rows with equal settings warped together; also plain decoding's choice (`plain_tokens`).

Sampling draws with an exponential race (argmax p_i / E_i with E_i ~ Exp(1) is distributed as p), which needs no
host round-trip on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
)

from ...models.errors import UserInputError

# Processors whose output depends on the scores alone: one call covers every slot of a block.
_CONTEXT_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                 TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """One draw per row of (R, V) probabilities (unnormalised is fine): argmax_i p_i / E_i with E_i ~ Exp(1).
    E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is i with probability p_i / sum(p): the
    categorical distribution, drawn without the host round-trip of `torch.multinomial`'s checks. E_i = 0 (possible
    in float) is raised to the smallest positive float, so a p_i = 0 never wins (0 / tiny = 0)."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(dim=-1)


def check_top_p(top_p: float) -> None:
    """One rule for top_p at every batch size (stock `generate` reads top_p=0 as top-1 at batch 1 only)."""
    if not 0 < top_p <= 1:
        raise ValueError(
            f"top_p must be in (0, 1] (1 = off), got {top_p}; for the single most likely token use greedy "
            "decoding (do_sample=False) or top_k=1."
        )


# Processors `generate` builds that keep state across calls, each with the option that builds it and what the state
# is. The loop calls a processor once per scored position (draft and verification slots, some later rejected), not
# once per emitted token, so such state would run out of step with the text and change the output silently.
STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": (
        "`guidance_scale`", "it runs the target on the unconditional prompt with a KV cache of its own, one position "
        "per call, which rejected drafts would advance"),
    "SynthIDTextWatermarkLogitsProcessor": (
        "`watermarking_config` (SynthID)", "it keeps the watermarking context and a history of the n-grams it has "
        "scored, one entry per call, which rejected drafts would advance"),
}


def check_sampling_processors(logits_processor) -> None:
    """What `generate` built from its options, held to the rules the batched engine applies (`check_top_p`), so
    one prompt and a batch accept and refuse the same settings; processors that keep state across calls
    (`STATEFUL_PROCESSORS`) are refused at every batch size, before any token."""
    for processor in logits_processor or ():
        name = type(processor).__name__
        if name in STATEFUL_PROCESSORS:
            option, why = STATEFUL_PROCESSORS[name]
            raise UserInputError(
                f"{option} cannot be combined with an hf_dspark drafter: {name} keeps state across calls ({why}), "
                f"so speculative decoding would not reproduce plain generate()'s output. Unset {option}, or call "
                "generate() without assistant_model / custom_generate for it."
            )
        if isinstance(processor, TopPLogitsWarper):
            check_top_p(float(processor.top_p))


def _warp(warpers: LogitsProcessorList, logits: torch.Tensor, context: torch.LongTensor | None = None) -> torch.Tensor:
    """Apply context-free warpers to (..., V) float logits, rows and slots flattened into one call."""
    if len(warpers) == 0:
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    if context is None:
        context = flat.new_zeros(flat.shape[0], 0, dtype=torch.long)
    return warpers(context, flat).reshape(logits.shape)


class ProcessorSampling:
    """Batch 1: `generate`'s processors and `do_sample`. Set `sequence` (1, L) to the committed text each round."""

    sampled_rows = None

    def __init__(self, logits_processor: LogitsProcessorList | None, do_sample: bool):
        self.processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.any_sampled = self.all_sampled = bool(do_sample)
        self.context_free = all(isinstance(p, _CONTEXT_FREE) for p in self.processors)
        self.sequence: torch.LongTensor | None = None

    def process(self, logits: torch.Tensor, drafted: torch.LongTensor) -> torch.Tensor:
        """(1, V) float logits of the slot after `drafted` (1, k) draft tokens."""
        if len(self.processors) == 0:
            return logits
        if self.context_free:
            return _warp(self.processors, logits, self.sequence)
        return self.processors(torch.cat([self.sequence, drafted], dim=-1), logits)

    def process_block(self, logits: torch.Tensor, drafts: torch.LongTensor) -> torch.Tensor:
        """(1, k + 1, V) target logits at the anchor and after each of the k drafts (1, k): slot i sees the
        sequence and drafts[:i], as the draft slot did (each slot processed exactly once)."""
        if len(self.processors) == 0:
            return logits
        if self.context_free:
            return _warp(self.processors, logits, self.sequence.expand(logits.shape[1], -1))
        processed = logits.clone()
        for i in range(logits.shape[1]):
            processed[:, i] = self.processors(torch.cat([self.sequence, drafts[:, :i]], dim=-1), logits[:, i])
        return processed

    def choose(self, processed: torch.Tensor, generator=None) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """(R, V) processed logits -> (tokens (R,), the distribution they were drawn from, None when greedy)."""
        if not self.any_sampled:
            return processed.argmax(dim=-1), None
        distribution = processed.softmax(dim=-1)
        return sample(distribution, generator), distribution


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens: greedy, or sampling through transformers' own warpers in `generate`'s
    order (temperature, top-k, top-p). Hashable, so rows with equal settings are warped together."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be positive when sampling, got {self.temperature}.")
        check_top_p(self.top_p)
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be a non-negative int (0 disables it), got {self.top_k!r}.")

    def warpers(self) -> LogitsProcessorList:
        """Empty when greedy: argmax is unchanged by them."""
        warpers = LogitsProcessorList()
        if not self.do_sample:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


class RowSampling:
    """The batched engine: the sampling settings of the current rows, grouped so that rows with equal settings
    share one warper pass. Greedy rows take the argmax and `greedy_verify`; sampled rows draw and go through
    `rejection_sample`. Everything it needs on the host is known from the settings. `plain_tokens` is plain
    decoding's choice, where a row may draw from a generator of its own (`generators`, None for the shared one)."""

    def __init__(self, settings: list[SamplingParams], device: torch.device,
                 generators: list[torch.Generator | None] | None = None):
        by_setting: dict[SamplingParams, list[int]] = {}
        for row, setting in enumerate(settings):
            by_setting.setdefault(setting, []).append(row)
        whole = len(by_setting) == 1
        self.groups = [(setting.warpers(), None if whole else torch.tensor(rows, device=device))
                       for setting, rows in by_setting.items()]
        sampled = [row for row, setting in enumerate(settings) if setting.do_sample]
        self.all_sampled = len(sampled) == len(settings)
        self.any_sampled = bool(sampled)
        self.sampled_rows = torch.tensor(sampled, dtype=torch.long, device=device)
        generators = generators or [None] * len(settings)
        self._own_generators = [generators[row] for row in sampled]
        self._kept = [settings[row] for row in sampled]
        self._device = device
        self._plain_parts: tuple | None = None  # built by plain decoding's first call (`_for_plain`)

    def _for_plain(self) -> tuple:
        """(the sampled rows' own `RowSampling`, their top-k bound or None, the positions drawing from the shared
        generator or None): what only plain decoding reads, built once, when it first runs."""
        if self._plain_parts is None:
            kept, own = self._kept, self._own_generators
            shared = [position for position, generator in enumerate(own) if generator is None]
            shared = torch.tensor(shared, dtype=torch.long, device=self._device) if 0 < len(shared) < len(own) else None
            # When every sampled row has a top-k, plain decoding warps and draws over the k largest logits only (k
            # the largest of the rows'): a top-k leaves every other token probability 0, so the distribution is the
            # same, without sorting and drawing over the whole vocabulary for top-p and the sampler.
            top_k = max(s.top_k for s in kept) if kept and all(s.top_k for s in kept) else None
            sampled_only = RowSampling(kept, self._device) if kept and not self.all_sampled else self
            self._plain_parts = (sampled_only, top_k, shared)
        return self._plain_parts

    def process(self, logits: torch.Tensor, drafted: torch.LongTensor | None = None) -> torch.Tensor:
        """(R, ..., V) logits, each row through its own warpers (applied exactly once; they read no context)."""
        if len(self.groups) == 1:
            return _warp(self.groups[0][0], logits)
        out = logits.clone()
        for warpers, rows in self.groups:
            out[rows] = _warp(warpers, logits[rows])
        return out

    def process_block(self, logits: torch.Tensor, drafts: torch.LongTensor | None = None) -> torch.Tensor:
        return self.process(logits)

    def choose(self, processed: torch.Tensor, generator=None) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """(R, V) processed logits -> (token per row, the distribution sampled rows drew from (0 for greedy rows),
        or None when no row samples)."""
        if self.all_sampled:
            distribution = processed.softmax(dim=-1)
            return sample(distribution, generator), distribution
        token = processed.argmax(dim=-1)
        if not self.any_sampled:
            return token, None
        rows = self.sampled_rows
        sampled = processed[rows].softmax(dim=-1)
        token[rows] = sample(sampled, generator)
        distribution = torch.zeros_like(processed)
        distribution[rows] = sampled
        return token, distribution

    def plain_tokens(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.LongTensor:
        """Plain decoding: (R, V) float logits -> (R,) tokens. Greedy rows take the argmax; sampled rows go through
        their own warpers and draw from their own generator when they have one (so a request's sample does not
        depend on its neighbours), else from `generator`."""
        tokens = logits.argmax(dim=-1)
        if not self.any_sampled:
            return tokens
        rows = self.sampled_rows
        sampled_only, top_k, shared = self._for_plain()
        scores, candidates = logits.index_select(0, rows), None
        if top_k is not None and top_k < scores.shape[-1]:
            scores, candidates = scores.topk(top_k, dim=-1)
        probs = sampled_only.process(scores).softmax(dim=-1)
        if all(own is None for own in self._own_generators):
            draws = sample(probs, generator)
        else:
            draws = torch.empty(len(self._own_generators), dtype=torch.long, device=logits.device)
            for position, own in enumerate(self._own_generators):
                if own is not None:
                    draws[position : position + 1] = sample(probs[position : position + 1], own)
            if shared is not None:
                draws[shared] = sample(probs.index_select(0, shared), generator)
        if candidates is not None:
            draws = candidates.gather(1, draws[:, None]).squeeze(1)
        return tokens.index_copy_(0, rows, draws)
