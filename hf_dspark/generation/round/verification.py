"""The lossless acceptance rule, in one place.

Given draft tokens x_1..x_k (row r drafts ``draft_lengths[r]`` of them) and the target's processed
distributions p_1..p_{k+1} at the same positions:

* greedy:   keep the longest prefix with x_i == argmax p_i, then emit argmax p_{n+1};
* sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) left to right; at the first rejection emit
  a sample of norm(max(p_i - q_i, 0)); if every draft was accepted emit the bonus token, a sample of p_{k+1}.

Either way the emitted tokens are distributed exactly as the target's own decoding (Leviathan et al. 2023,
Chen et al. 2023). Shapes: R rows (requests), k draft slots, V vocabulary. Nothing here reads a value back to the
host: the caller fetches the (number accepted, next token) pair once.
"""

from __future__ import annotations

import torch

from .sampling import sample


def _slot_is_drafted(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    rows, slots = draft_tokens.shape
    if draft_lengths is None:
        return torch.ones(rows, slots, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(slots, device=draft_tokens.device)[None, :] < draft_lengths[:, None]


def greedy_verify(
    draft_tokens: torch.LongTensor,
    target_logits: torch.Tensor,
    draft_lengths: torch.LongTensor | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """draft_tokens (R, k), target_logits (R, k+1, V) -> (number accepted (R,), next token (R,))."""
    target_tokens = target_logits.argmax(dim=-1)
    matches = (draft_tokens == target_tokens[:, :-1]) & _slot_is_drafted(draft_tokens, draft_lengths)
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def rejection_sample(
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_lengths: torch.LongTensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """draft_tokens (R, k), draft_probs q (R, k, V), target_probs p (R, k+1, V) -> (number accepted, next token)."""
    rows, slots = draft_tokens.shape
    row_index = torch.arange(rows, device=draft_tokens.device)
    drafted = _slot_is_drafted(draft_tokens, draft_lengths)

    p_of_draft = target_probs[:, :slots].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand(rows, slots, device=draft_tokens.device, generator=generator)
    accepted = (uniform * q_of_draft < p_of_draft) & drafted  # P(u < p/q) = min(1, p/q); p = 0 never passes
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)

    p_next = target_probs[row_index, num_accepted]
    q_next = torch.zeros_like(p_next)  # no rejection (bonus token): sample from p itself
    if slots > 0:
        slot = num_accepted.clamp(max=slots - 1)
        was_rejected = drafted[row_index, slot] & (num_accepted < slots)
        q_next = draft_probs[row_index, slot] * was_rejected[:, None]
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass is 0 only when p == q up to rounding, where a rejection has probability ~0: fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    return num_accepted, sample(residual, generator)


def verify_drafts(sampling, target_logits: torch.Tensor, drafts: Drafts, generator: torch.Generator | None = None):
    """Process the target's logits at the anchor and every draft (R, k + 1, V) exactly once and apply the lossless
    rule of `verification.py` (greedy rows: `greedy_verify`; sampled rows: `rejection_sample`).

    Returns (number accepted (R,), next token (R,), processed target logits)."""
    slots = target_logits.shape[1] - 1
    draft_tokens = drafts.tokens[:, :slots]
    processed = sampling.process_block(target_logits, draft_tokens)
    if not sampling.any_sampled:
        return (*greedy_verify(draft_tokens, processed, drafts.lengths), processed)
    draft_probs = drafts.probs[:, :slots] if drafts.probs is not None else processed[:, :0].softmax(-1)
    if sampling.all_sampled:
        return (*rejection_sample(draft_tokens, draft_probs, processed.softmax(dim=-1), drafts.lengths, generator),
                processed)
    num_accepted, next_token = greedy_verify(draft_tokens, processed, drafts.lengths)
    rows = sampling.sampled_rows
    accepted, token = rejection_sample(draft_tokens[rows], draft_probs[rows], processed[rows].softmax(dim=-1),
                                       drafts.lengths[rows], generator)
    num_accepted[rows], next_token[rows] = accepted, token
    return num_accepted, next_token, processed
