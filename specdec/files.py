"""Files that appear under their final name only complete: written to a temporary file in the
same folder, synced, then renamed over (a rename within one filesystem is atomic), so a process
stopped mid-write leaves the old file, or a stray hidden temporary one, never a truncated file.
"""
from __future__ import annotations

import os


def temporary_path(path: str) -> str:
    """Where `path` is written before the rename: same folder (a rename within one filesystem is
    atomic), hidden (evaluators globbing *.png skip it), unique per process."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")


def atomic_write(path: str, data: bytes) -> None:
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


__all__ = ["atomic_write", "temporary_path"]
