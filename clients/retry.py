"""When a request is sent again: busy answers (429, 503) and refused connections, with backoff or Retry-After."""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

import httpx

RETRY_STATUS_CODES = frozenset({429, 503})
# Failures before the server saw the request: sending it again cannot do the work twice.
RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 4
    backoff_base: float = 0.5  # seconds before the first retry; doubles each retry
    backoff_max: float = 8.0
    max_retry_wait: float = 60.0  # cap on a server's Retry-After

    def delay(self, attempt: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before sending again after try number `attempt` (from 0) failed; None when the
        failure is final (retries used up, or a status no retry would change). `response` is None when the
        server could not be reached."""
        if attempt >= self.max_retries:
            return None
        if response is not None:
            if response.status_code not in RETRY_STATUS_CODES:
                return None
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            if retry_after is not None:
                return min(retry_after, self.max_retry_wait)
        # A little jitter so that many clients turned away together do not come back in lockstep.
        return min(self.backoff_max, self.backoff_base * 2**attempt) * (1.0 + 0.1 * random.random())
