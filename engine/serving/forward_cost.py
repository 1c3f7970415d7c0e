"""ForwardCost: how long a forward over N tokens takes, fitted to the recent forwards.

seconds = fixed + per_token * N, by least squares over a window of (N, seconds). The fixed part
(the per-layer Python and kernel-launch overhead) matters: sizing a turn by the average cost per
token alone would overrate the cost of large batches and starve them. With too little spread in
N to fit a line, the average seconds per token is used (a cautious estimate: it folds the fixed
part into every token).
"""

from __future__ import annotations

import collections

_MIN_SPREAD_TOKENS = 8.0  # below this standard deviation of N, a fitted slope is noise


class ForwardCost:
    def __init__(self, window: int = 32) -> None:
        self._samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def note(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._samples.append((num_tokens, seconds))

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens one forward is expected to take in `seconds` (at least 0); None before any forward."""
        if not self._samples:
            return None
        fixed, per_token = self.fit()
        return max(int((seconds - fixed) / per_token), 0)

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token); per-token is always positive."""
        n = len(self._samples)
        mean_tokens = sum(t for t, _ in self._samples) / n
        mean_seconds = sum(s for _, s in self._samples) / n
        variance = sum((t - mean_tokens) ** 2 for t, _ in self._samples) / n
        if variance >= _MIN_SPREAD_TOKENS**2:
            covariance = sum((t - mean_tokens) * (s - mean_seconds) for t, s in self._samples) / n
            per_token = covariance / variance
            fixed = mean_seconds - per_token * mean_tokens
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, mean_seconds / mean_tokens
