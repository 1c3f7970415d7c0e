"""Prompt-lookup proposals: continue the text the way it went on after the same n tokens last time.

No model runs. When an answer copies its input (an edit, a fix, a quote, an extraction), the last few
tokens it wrote almost always occur earlier in the prompt, and the tokens that followed them there are
what it writes next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n tokens.

    n runs from ngram_max down to ngram_min; the longest suffix that occurs earlier wins, and among its
    occurrences the latest (the most recent context). Returns [] when no suffix of length >= ngram_min
    occurs earlier. The proposal stops where the token list ends.
    """
    length = len(token_ids)
    if num_tokens <= 0 or length <= ngram_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # windows[i] = tokens[i : i + n] for every start i whose window ends before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + num_tokens].tolist()
    return []


def reference_propose_ngram(token_ids: Sequence[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The same proposal by plain loops: the reference `propose_ngram` is tested against."""
    tokens = list(token_ids)
    length = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []
