"""Sampling: pure functions from a batch of logits and per-row parameters to token ids.

Order, as in vLLM: logprobs come from the raw model distribution; then
penalties, logit bias and the min_tokens ban edit the logits; then temperature,
top-k, top-p and min-p shape the distribution; greedy rows take the argmax.

A seeded row draws from its own generator, one draw per step, so its tokens do
not depend on what else is in the batch. Distributions are built from each
row's best candidates (a top-k) instead of a full sort of the vocabulary, with
the full-sort reference next to it (tests hold them equal).
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


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: repetition (prompt + output, HF rule), presence and frequency (output only, OpenAI rule)."""
    vocab = logits.shape[1]
    needs = [_has_penalties(r.params) for r in rows]
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


def reference_distribution(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Plain top-k -> top-p -> min-p over a full sort: probabilities [R, V]. The reference."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs_sorted = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    probs = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits).softmax(dim=-1)
    return _apply_min_p(probs, min_p)


def _row_totals(probs: torch.Tensor) -> torch.Tensor:
    """Each row's sum [R, 1], added in the same order whatever the batch (a cumsum's last entry): torch's sum over
    a row splits it between threads by the number of rows, which moved a seeded draw at a CDF boundary when the
    same row ran beside others."""
    return probs.cumsum(dim=-1)[:, -1:]


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens under min_p times each row's top probability, renormalised; rows as they are when no row
    has a min_p."""
    if not bool((min_p > 0).any()):
        return probs
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / _row_totals(probs)


def candidate_distribution(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, num_candidates: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same distribution restricted to each row's best `num_candidates` tokens.

    Returns (probs [R, C], token ids [R, C], decided [R]). A row is decided when
    every token it may sample is a candidate (top-k <= C, or the top-p nucleus or
    the min-p cut closes inside the candidates); undecided rows need the full
    vocabulary. A full sort of a 50k vocabulary costs milliseconds per row on a
    CPU; a top-256 does not.
    """
    vocab = logits.shape[1]
    finite_k = [k for k in top_k.tolist() if k < vocab]
    count = min(vocab, max([num_candidates, *finite_k]))
    values, token_ids = logits.topk(count, dim=-1)  # best first
    ranks = torch.arange(count, device=logits.device).unsqueeze(0)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    k_inside = top_k <= count
    # True probabilities: normalised over the top-k survivors when they are all candidates, else the vocabulary.
    log_norm = torch.where(k_inside, values.logsumexp(-1), logits.logsumexp(-1))
    probs = (values - log_norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    mass_before = cumulative - probs
    nucleus_inside = cumulative[:, -1] >= top_p
    min_p_inside = (min_p > 0) & (probs[:, -1] < min_p * probs[:, 0])
    decided = k_inside | nucleus_inside | min_p_inside
    probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    probs = probs / _row_totals(probs)
    return _apply_min_p(probs, min_p), token_ids, decided


def draw_uniforms(rows: list[SamplingRow], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One uniform per row [R, 1], in row order: a seeded row takes the next draw of its own generator
    (so its draws do not depend on the rest of the batch), the others share torch's global one."""
    uniform = torch.empty(len(rows), 1, dtype=dtype, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), 1, dtype=dtype, device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i] = torch.rand(1, generator=row.generator, dtype=dtype, device=device)
    return uniform


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row from probs [R, N] by inverse CDF with uniform [R, 1] (torch.multinomial is slow on CPU)."""
    cdf = probs.cumsum(dim=-1)
    # right=True: the first index whose cdf exceeds u, so a zero-probability token is never picked.
    picks = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    return picks.clamp_(max=probs.shape[1] - 1)


def _shaping(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits / temperature, top_k [R] with "off" as the vocabulary size, top_p [R], min_p [R])."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    vocab = logits.shape[1]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=device)
    return logits / temperature.unsqueeze(1), top_k, top_p, min_p


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row -> token ids [R]."""
    device = logits.device
    logits, top_k, top_p, min_p = _shaping(logits, rows)
    vocab = logits.shape[1]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
    # Drawn first, in row order: rows of one sequence (a token and its speculative drafts) take their
    # generator's draws in position order, as one-at-a-time decoding would.
    uniform = draw_uniforms(rows, logits.dtype, device)
    unrestricted = (top_k >= vocab) & (top_p >= 1.0) & (min_p <= 0.0)
    dense_rows = (~unrestricted).nonzero().flatten().tolist()
    # Few candidates first; a flat row gets a second, wider look before the full sort.
    for num_candidates in (256, 4096):
        if not dense_rows:
            break
        probs, candidates, decided = candidate_distribution(
            logits[dense_rows], top_k[dense_rows], top_p[dense_rows], min_p[dense_rows], num_candidates
        )
        done = decided.nonzero().flatten().tolist()
        if done:
            picks = _draw(probs[done], uniform[[dense_rows[i] for i in done]])
            chosen = candidates[done].gather(1, picks.unsqueeze(1)).squeeze(1)
            token_ids[[dense_rows[i] for i in done]] = chosen
        dense_rows = [dense_rows[i] for i in (~decided).nonzero().flatten().tolist()]
    dense_rows += unrestricted.nonzero().flatten().tolist()
    if dense_rows:
        sub = logits[dense_rows]
        if bool((top_p[dense_rows] < 1.0).any()):
            dense = reference_distribution(sub, top_k[dense_rows], top_p[dense_rows], min_p[dense_rows])
        else:  # no nucleus to find: a plain softmax, no sort
            dense = _apply_min_p(sub.softmax(dim=-1), min_p[dense_rows])
        token_ids[dense_rows] = _draw(dense, uniform[dense_rows])
    return token_ids


def token_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob of token_ids[row] under raw_logprobs [R, V] (None where the row asked for none)."""
    wanted = [r.params.logprobs for r in rows]
    if all(w is None for w in wanted):
        return [None] * len(rows)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(w or 0 for w in wanted)
    top_values, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    out: list[TokenLogprob | None] = []
    for i, w in enumerate(wanted):
        if w is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i, :w].tolist(), top_values[i, :w].tolist())) if w else []
        out.append(TokenLogprob(token_id=int(token_ids[i]), logprob=chosen[i], top=top))
    return out


def needs_adjusting(row: SamplingRow) -> bool:
    """Whether adjusted_logits changes anything in this row's logits."""
    p = row.params
    return _has_penalties(p) or bool(p.logit_bias) or len(row.token_ids) - row.num_prompt_tokens < p.min_tokens


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of logits [R, V] with penalties, logit bias and the min_tokens ban applied (the greedy argmax)."""
    logits = logits.clone()
    _apply_penalties(logits, rows)
    _apply_bias_and_bans(logits, rows)
    return logits


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The full distribution [R, V] that `sample` draws each random row from (rows must not be greedy).

    The plain full-vocabulary form of what `sample` computes: adjusted logits, temperature, then
    top-k, top-p and min-p (the p of speculative decoding's reference rejection rule).
    """
    logits, top_k, top_p, min_p = _shaping(adjusted_logits(logits, rows), rows)
    vocab = logits.shape[1]
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        return reference_distribution(logits, top_k, top_p, min_p)
    return _apply_min_p(logits.softmax(dim=-1), min_p)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R]: each row's first maximum (a NaN counts as the maximum) of logits [R, V]. On the CPU through
    numpy, whose argmax over a 50,000-entry row takes a tenth of torch's time (4 against 43 us on 2 cores)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits: float32 [R, V], one row per sequence that samples this step."""
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in rows):
        raw_logprobs = logits.log_softmax(dim=-1)
    if any(needs_adjusting(r) for r in rows):  # else the logits are read, never written: no copy
        logits = adjusted_logits(logits, rows)
    token_ids = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        token_ids[random_rows] = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
    logprobs = token_logprobs(raw_logprobs, token_ids, rows) if raw_logprobs is not None else [None] * len(rows)
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)
