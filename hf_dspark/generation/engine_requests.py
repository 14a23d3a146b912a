"""The batched engine's request bookkeeping: what a request asked for and has produced, what a batch returns, the
parked cache a conversation's next turn continues from, and the snapshot that undoes a failed step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch_state import BatchRows
from .sampling import SamplingParams
from .stats import SpeculativeStats
from .transformers_internals import restore_layers, snapshot_layers


@dataclass
class BatchedOutput:
    """What `batched_speculative_generate` returns.

    sequences: per request, its prompt (without padding) followed by the new tokens.
    stats: per request, one `SpeculativeStats` entry per verification round it took part in.
    verified_tokens_per_round: per round, the tokens in the target forward summed over active requests,
        sum(k_r + 1) (padding excluded): the verification batch B the scheduler prices.
    """

    sequences: list[torch.LongTensor]
    stats: list[SpeculativeStats]
    verified_tokens_per_round: list[int] = field(default_factory=list)


@dataclass
class ParkedCache:
    """A finished request's target-cache entries, kept so that a later request continuing its text (the next turn
    of a conversation) runs only its new tokens. `tokens` are the ids the entries cover: the request's prompt and
    output but its last token, which never went through the target."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, heads, len(tokens), dim)


@dataclass
class Request:
    """One request's settings and output so far."""

    tokens: list[int]  # prompt, then the new tokens
    max_new_tokens: int
    sampling: SamplingParams
    eos: set[int]
    generator: torch.Generator | None = None  # its own random source (plain decoding), else the engine's
    resume: ParkedCache | None = None  # entries to continue from instead of prefilling the whole prompt
    keep_cache: bool = False  # park its cache when it finishes
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    emitted: int = 0


def eos_ids(target, eos_token_id) -> set[int]:
    """Like `generate`: None falls back to the target's generation config."""
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.flatten().tolist())
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def emit(requests: list[Request], new_tokens: list[list[int]], counts: list[int]) -> list[bool]:
    """Append each row's first `counts[r]` tokens (host ints), stopping after an EOS or at `max_new_tokens` exactly
    as plain decoding would (every row's EOS found at once in the values read). Returns which rows finished."""
    finished = []
    for request, tokens, count in zip(requests, new_tokens, counts):
        done = False
        for token in tokens[:count]:
            request.tokens.append(token)
            request.emitted += 1
            if token in request.eos or request.emitted >= request.max_new_tokens:
                done = True
                break
        finished.append(done)
    return finished


@dataclass
class EngineSnapshot:
    """The engine's state before a step, by reference: every cache update and row edit replaces tensors, or writes
    cache entries past the lengths kept here, so keeping the old references is enough to undo a step."""

    waiting: list[int]
    rows: BatchRows | None
    row_fields: dict
    target_layers: list[dict]
    draft_layers: tuple[list, list]
    requests: dict[int, tuple[int, int, int]]  # request id -> (tokens, emitted, rounds recorded)
    parked: list[int]
    resumes: dict[int, ParkedCache]  # the parked caches waiting requests continue from (admission lets them go)
    rounds: int

    @classmethod
    def take(cls, waiting: list[int], rows: BatchRows | None, requests: dict[int, Request], parked: dict,
             rounds: int) -> "EngineSnapshot":
        counts = {r: (len(q.tokens), q.emitted, q.stats.num_rounds) for r, q in requests.items()}
        resumes = {r: requests[r].resume for r in waiting if requests[r].resume is not None}
        if rows is None:
            return cls(list(waiting), None, {}, [], ([], []), counts, list(parked), resumes, rounds)
        return cls(list(waiting), rows, dict(vars(rows)), snapshot_layers(rows.target_cache),
                   (list(rows.draft_cache.keys), list(rows.draft_cache.values)), counts, list(parked), resumes,
                   rounds)

    def restore(self, requests: dict[int, Request], parked: dict, verified_tokens_per_round: list[int]) -> None:
        """Put the rows, requests, parked caches and per-round records back (the caller resets its own fields)."""
        rows = self.rows
        if rows is not None:
            vars(rows).clear()
            vars(rows).update(self.row_fields)
            restore_layers(rows.target_cache, self.target_layers)
            rows.draft_cache.keys, rows.draft_cache.values = (list(k) for k in self.draft_layers)
        for request_id, (length, emitted, rounds) in self.requests.items():
            request = requests[request_id]
            del request.tokens[length:]
            request.emitted = emitted
            for per_round in vars(request.stats).values():  # draft_lengths, accepted, confidences, ...
                if isinstance(per_round, list):
                    del per_round[rounds:]
        for request_id, resume in self.resumes.items():
            requests[request_id].resume = resume
        for request_id in [r for r in parked if r not in self.parked]:
            del parked[request_id]
        del verified_tokens_per_round[self.rounds:]
