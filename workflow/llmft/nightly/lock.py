"""The nightly lock: one nightly run, promote or rollback at a time on a results folder."""

from __future__ import annotations

import fcntl
import os
from datetime import datetime, timezone
from pathlib import Path


class NightlyLocked(RuntimeError):
    """Another nightly run holds the lock."""


class Lock:
    """An exclusive, non-blocking flock on results/nightly/lock; released when the process dies."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.seek(0)
            holder = self.fh.read().strip() or "unknown"
            self.fh.close()
            raise NightlyLocked(
                f"another nightly run holds {self.path} ({holder}); not starting a second one"
            ) from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(f"pid {os.getpid()} since {datetime.now(timezone.utc).isoformat(timespec='seconds')}")
        self.fh.flush()
        return self

    def __exit__(self, *exc):
        self.fh.close()
