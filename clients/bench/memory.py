"""The server's peak memory during a run, sampled from outside its process."""

from __future__ import annotations

import threading
from pathlib import Path


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid` and its children (0 once it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0


class MemorySampler:
    """Samples the RSS of a process and its children in a thread; also reads the kernel's VmHWM."""

    def __init__(self, pid: int | None, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        return rss_bytes(self.pid) if self.pid is not None else 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:  # noqa: PYI034 - keeps Python 3.10 working
        if self.pid is not None:
            self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._rss())

    @property
    def peak_rss_mib(self) -> float | None:
        return self.peak_rss_bytes / 2**20 if self.pid is not None and self.peak_rss_bytes else None

    def vm_hwm_mib(self) -> float | None:
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
        except OSError:
            return None
        return None
