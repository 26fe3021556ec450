"""Atomic file output: write to a temporary name beside the target, then rename.

A killed job never leaves a half-written file that a later run would trust.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(target: str | Path, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path; on success move it onto `target`, on error remove it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp creates 0700
    else:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        # mkstemp creates 0600; outputs are shared (cluster users, web servers): honour the umask.
        tmp.chmod(0o666 & ~_umask())
    try:
        yield tmp
        if directory and target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(target: str | Path, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: str | Path, obj: Any) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_jsonl(target: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(target) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_optional(path: Path, default=None):
    """Optional inputs (a run from an older version, a stage that wrote less) read as `default`."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return default


def path_problem(path: str | Path) -> str | None:
    """Why `path` is not a regular file or folder to read, or None when it is one.

    Checked before opening: a FIFO blocks the open until a writer comes, and a device (/dev/zero)
    never ends, so both are refused by kind; a symlink loop is named, not reported as missing."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "not found"
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        kind = "a FIFO (named pipe)"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        kind = "a device"
    else:
        kind = "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    return f"is {kind}, not a regular file (never opened: reading it could block or never end)"
