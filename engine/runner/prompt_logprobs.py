"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

They come out of the prefill that computes the prompt's KV anyway: the hidden state at position p
gives the logits that score token p + 1. Only the rows of sequences that ask are turned into
logits, and only `ROWS_PER_SLICE` rows at a time, so memory stays bounded however long the prompt
or the prefill chunk: a 2,048-token chunk against a 49,152-token vocabulary would otherwise be a
400 MB float32 matrix. The distribution is the raw model's (no temperature, penalty, bias or
grammar mask), as for the sampled tokens' logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.outputs import TokenLogprob

ROWS_PER_SLICE = 64  # logits rows alive at once: [64, vocab] float32


@dataclass(frozen=True)
class PromptRows:
    """The rows of one step's flat hidden states that score prompt tokens of one sequence."""

    seq: Sequence
    first_row: int  # index into the step's [T, hidden] states
    first_position: int  # the prompt position of that row: it scores token first_position + 1
    count: int


def prompt_rows(batch: ScheduledBatch) -> list[PromptRows]:
    """Which rows of this step score prompt tokens, for every sequence that still owes them.

    Positions already scored are skipped (a sequence preempted in its prompt computes it again),
    and so is the prompt's last position: its logits score the first generated token, the sampler's job.
    """
    found = []
    row = 0
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        if seq.needs_prompt_logprobs:
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs))
            end = min(start + num_new, seq.num_prompt_tokens - 1)
            if end > first:
                found.append(PromptRows(seq, row + first - start, first, end - first))
        row += num_new
    return found


def score_prompt_tokens(
    hidden: torch.Tensor, rows: list[PromptRows], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[Sequence, list[TokenLogprob]]:
    """hidden: [T, hidden] final hidden states of the step. Returns each sequence's scored tokens, in order."""
    row_index: list[int] = []
    targets: list[int] = []
    num_top: list[int] = []
    for part in rows:
        row_index.extend(range(part.first_row, part.first_row + part.count))
        first = part.first_position + 1
        targets.extend(part.seq.token_ids[first : first + part.count])
        num_top.extend([part.seq.params.prompt_logprobs or 0] * part.count)
    scored: list[TokenLogprob] = []
    max_top = max(num_top, default=0)
    device = hidden.device
    for begin in range(0, len(row_index), ROWS_PER_SLICE):
        index = torch.tensor(row_index[begin : begin + ROWS_PER_SLICE], device=device)
        target = torch.tensor(targets[begin : begin + ROWS_PER_SLICE], device=device)
        logprobs = compute_logits(hidden[index]).float().log_softmax(dim=-1)  # [rows, vocab]
        chosen = logprobs.gather(1, target.unsqueeze(1))  # [rows, 1]
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        top_ids, top_values = [], []
        if max_top:
            values, ids = logprobs.topk(max_top, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        for i, (token_id, logprob, rank) in enumerate(zip(target.tolist(), chosen.squeeze(1).tolist(), ranks)):
            k = num_top[begin + i]
            top = list(zip(top_ids[i][:k], top_values[i][:k])) if k else []
            scored.append(TokenLogprob(token_id=token_id, logprob=logprob, top=top, rank=rank))
    by_seq: dict[Sequence, list[TokenLogprob]] = {}
    offset = 0
    for part in rows:
        by_seq[part.seq] = scored[offset : offset + part.count]
        offset += part.count
    return by_seq
