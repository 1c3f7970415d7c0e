"""The one log setup of the client programs (chat, the benchmarks): timestamped lines on stderr."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str = logging.INFO, *, quiet_httpx: bool = True) -> None:
    """Log at `level` (a number or a name such as "INFO") to stderr.

    quiet_httpx: keep httpx to warnings; its one INFO line per request would drown a program's report.
    """
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    if quiet_httpx:
        logging.getLogger("httpx").setLevel(logging.WARNING)
