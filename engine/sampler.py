"""Sampling: pure functions from a batch of logits and per-row parameters to token ids.

Order, as in vLLM: logprobs come from the raw model distribution; then
penalties, logit bias and the min_tokens ban edit the logits; then temperature,
top-k, top-p and min-p shape the distribution; greedy rows take the argmax.

Randomness uses the exponential race (argmax of p / q with q ~ Exp(1)), which
draws exactly one vocab-sized vector per row per step, so a seeded row's tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row (one sequence that samples this step)."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: repetition (prompt + output, HF rule), presence and frequency (output only, OpenAI rule)."""
    vocab = logits.shape[1]
    needs = [
        r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
        for r in rows
    ]
    if not any(needs):
        return
    device = logits.device
    for i, row in enumerate(rows):
        if not needs[i]:
            continue
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=device)
            seen = seen[seen < vocab]
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            output = torch.tensor(row.token_ids[row.num_prompt_tokens :], dtype=torch.long, device=device)
            output = output[output < vocab]
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.scatter_add_(0, output, torch.ones_like(output, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_bias_and_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            if ids:
                logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
        num_generated = len(row.token_ids) - row.num_prompt_tokens
        if num_generated < p.min_tokens:
            banned = [t for t in set(row.eos_token_ids) | set(p.stop_token_ids) if t < vocab]
            if banned:
                logits[i, banned] = float("-inf")


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Reference top-k then top-p over a full sort (slow on CPU for big vocabularies)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs_sorted = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int = 256):
    """Mask everything outside top-k, then outside the top-p nucleus, to -inf.

    top_k: [R] (vocab size = off), top_p: [R]. A full sort of a 50k vocabulary
    costs milliseconds per row on a CPU, so rows are first decided from the
    best `num_candidates` tokens; only a row whose nucleus is not contained in
    them (a very flat distribution) falls back to the full sort.
    """
    vocab = logits.shape[1]
    finite_k = [k for k in top_k.tolist() if k < vocab]
    count = min(vocab, max([num_candidates, *finite_k]))
    values, indices = logits.topk(count, dim=-1)  # sorted, best first
    ranks = torch.arange(count, device=logits.device).unsqueeze(0)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    k_inside = top_k <= count
    # Normaliser: the top-k survivors when they are all candidates, else the whole vocabulary.
    log_norm = torch.where(k_inside, values.logsumexp(-1), logits.logsumexp(-1))
    probs = (values - log_norm.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(1, indices, values)
    undecided = ~k_inside & (probs.sum(-1) < top_p)
    if undecided.any():
        rows = undecided.nonzero().flatten()
        out[rows] = _sorted_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
    return out


def _shape_distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p -> probabilities [R, V] (rows all non-greedy)."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(
            logits, torch.tensor(top_k, device=device), torch.tensor(top_p, dtype=logits.dtype, device=device)
        )
    probs = logits.softmax(dim=-1)
    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _exponential_race(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    return (probs / noise).argmax(dim=-1)


def _logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[TokenLogprob | None]:
    wanted = [r.params.logprobs for r in rows]
    if all(w is None for w in wanted):
        return [None] * len(rows)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(w or 0 for w in wanted)
    top_values, top_ids = (raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None))
    out: list[TokenLogprob | None] = []
    for i, w in enumerate(wanted):
        if w is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i, :w].tolist(), top_values[i, :w].tolist())) if w else []
        out.append(TokenLogprob(token_id=int(token_ids[i]), logprob=chosen[i], top=top))
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits: float32 [R, V], one row per sequence that samples this step."""
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in rows):
        raw_logprobs = logits.log_softmax(dim=-1)
    logits = logits.clone()
    _apply_penalties(logits, rows)
    _apply_bias_and_bans(logits, rows)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        sub_rows = [rows[i] for i in random_rows]
        probs = _shape_distribution(logits[random_rows], sub_rows)
        token_ids[random_rows] = _exponential_race(probs, sub_rows)
    logprobs = _logprobs(raw_logprobs, token_ids, rows) if raw_logprobs is not None else [None] * len(rows)
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)
