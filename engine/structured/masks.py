"""Grammar masks on the logits: each constrained row keeps only the tokens its matcher allows next.

Applied to the raw logits before the sampler, so everything after it (penalties, temperature,
top-k/p, the logprobs a request asks for) sees the constrained distribution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.structured.thinking import grammar_constraint


def apply_grammar_masks(logits: torch.Tensor, matchers: list[Any | None], eos_token_ids: tuple[int, ...]) -> None:
    """logits: [R, V] float32, one row per sampling sequence; matchers[i]: row i's matcher or None (a
    ThinkingFirst one constrains nothing while its sequence thinks, engine/structured/thinking.py).

    Every token the matcher does not allow gets -inf, in place. A matcher that allows nothing (it
    has ended or failed) leaves EOS allowed, so the row ends instead of sampling from nothing.
    """
    constraints = [grammar_constraint(matcher) if matcher is not None else (None, ()) for matcher in matchers]
    rows = [i for i, (active, _) in enumerate(constraints) if active is not None]
    if not rows:
        return
    import llguidance.numpy

    vocab_size = logits.shape[1]
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab_size)  # [k, ceil(V / 32)] int32
    for k, i in enumerate(rows):
        llguidance.numpy.fill_next_token_bitmask(constraints[i][0], bitmask, k)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)
    for k in np.flatnonzero(~allowed.any(axis=1)):
        allowed[k, [t for t in eos_token_ids if t < vocab_size]] = True
    for k, i in enumerate(rows):
        allowed[k, [t for t in constraints[i][1] if t < vocab_size]] = True
    row_index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, row_index)
    constrained.masked_fill_(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
    logits.index_copy_(0, row_index, constrained)
