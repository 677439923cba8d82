"""Files of a `specdec sample` directory: atomic writes, the manifest of finished images, and the
ADM-layout samples.npz.

Every file appears under its final name only complete (written to a temporary file in the same
folder, synced, then renamed over), so a killed process leaves at most a stray temporary file.
An image counts as done only when a manifest line records it and the PNG on disk has the hash
that line recorded: a PNG from any other source (a half-copied file, another run) is redone.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import io
import json
import os
import warnings
import zipfile
from typing import Dict, Iterable, Optional, Tuple

import numpy as np

from specdec.files import atomic_write, temporary_path

MANIFEST_DIR = "manifest"
STATS_DIR = "stats"


#: the lock a run's rank 0 holds on its directory (see `lock_run`)
LOCK_FILE = ".lock"


#: `atomic_write`'s temporary files (`.name.tmp-PID`, specdec.files.temporary_path)
TEMPORARY = ".*.tmp-*"


def is_temporary(name: str) -> bool:
    return fnmatch.fnmatch(name, TEMPORARY)


def lock_run(out_dir: str):
    """Rank 0's exclusive lock on the directory, held (by the returned open file) until it is
    closed or the process ends: a second run on the same directory would delete the first one's
    temporary files and decode its images again. A filesystem that takes no flock (Lustre without
    `-o flock`, NFS without a lock daemon) gets a warning and the run goes on unlocked."""
    import errno
    import fcntl

    f = open(os.path.join(out_dir, LOCK_FILE), "a")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            warnings.warn(f"--out {out_dir}: its filesystem takes no lock ({e.strerror}); nothing stops a second "
                          "run on this directory meanwhile", stacklevel=2)
            return f
        f.close()
        raise BlockingIOError(f"--out {out_dir} is in use by another specdec sample run (it holds {LOCK_FILE}); "
                              "wait for it to end or choose another --out") from None
    return f


def remove_temporaries(out_dir: str) -> int:
    """Delete the temporary files killed processes left (call before any process of the new run
    writes: a live writer's temporary file would be removed too). Returns how many."""
    stale = glob.glob(os.path.join(glob.escape(out_dir), "**", TEMPORARY), recursive=True)
    for path in stale:
        os.remove(path)
    return len(stale)


def remove_rank_stats(out_dir: str) -> None:
    """Delete the per-rank statistics of earlier runs (STATS_DIR/rank*.json; call before any
    process of the new run writes)."""
    for path in glob.glob(os.path.join(glob.escape(out_dir), STATS_DIR, "rank*.json")):
        os.remove(path)


def atomic_write_json(path: str, obj) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def png_bytes(image: np.ndarray) -> bytes:
    """uint8 [h, w, C] -> PNG bytes: gray ("L") for one channel, RGB for three."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buf, format="PNG")
    return buf.getvalue()


def png_rgb(data: bytes) -> np.ndarray:
    """PNG bytes -> uint8 [h, w, 3] (gray replicated to three channels)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


# ----------------------------------------------------------------------------------------------
# manifest
# ----------------------------------------------------------------------------------------------

def manifest_path(out_dir: str, rank: int, attempt: str) -> str:
    """One append-only file per rank and attempt: no two processes ever write the same file, and
    a resumed run never appends to a file whose last line a killed process left unfinished."""
    return os.path.join(out_dir, MANIFEST_DIR, f"{attempt}-rank{rank:04d}.jsonl")


class ManifestWriter:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self._f = open(path, "a")

    def add(self, record: dict) -> None:
        # One write per complete line, synced: a record is on disk before the image counts as done.
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_manifest(out_dir: str) -> Dict[int, dict]:
    """Index -> record over every manifest file; a line a killed process left half-written is
    skipped (its image is then redone)."""
    records: Dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(out_dir), MANIFEST_DIR, "*.jsonl"))):
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:      # (not JSON, or not UTF-8: a damaged line)
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("i"), int):
                    records[rec["i"]] = rec
    return records


def verified(out_dir: str, record: Optional[dict], path: str) -> Optional[bytes]:
    """The PNG's bytes when `record` says it was finished at `path` and the file still hashes to
    what was recorded; None when the image must be (re)done."""
    if record is None or record.get("path") != path:
        return None
    full = os.path.join(out_dir, path)
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if sha256(data) == record.get("sha256") else None


class LineCounter:
    """Records written so far to the manifest files of one attempt (rank 0's progress bar reads
    the other ranks' files; only the bytes added since the last call are read)."""

    def __init__(self, out_dir: str, attempt: str):
        self.pattern = os.path.join(glob.escape(out_dir), MANIFEST_DIR, f"{attempt}-rank*.jsonl")
        self.seen: Dict[str, Tuple[int, int]] = {}

    def __call__(self) -> int:
        for path in glob.glob(self.pattern):
            offset, count = self.seen.get(path, (0, 0))
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            self.seen[path] = (offset + len(chunk), count + chunk.count(b"\n"))
        return sum(count for _, count in self.seen.values())


# ----------------------------------------------------------------------------------------------
# samples.npz
# ----------------------------------------------------------------------------------------------

def write_npz(path: str, images: Iterable[np.ndarray], shape: Tuple[int, int, int, int]) -> None:
    """uint8 [N, H, W, 3] under arr_0, as np.savez writes it (what the ADM evaluator loads), but
    streamed one image at a time: 50,000 ImageNet-size images would not fit in memory at once."""
    tmp = temporary_path(path)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}
    written = 0
    try:
        with open(tmp, "wb") as raw:
            with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                with zf.open("arr_0.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array_header_1_0(f, header)
                    for image in images:
                        if image.shape != shape[1:] or image.dtype != np.uint8:
                            raise ValueError(f"image {written} is {image.dtype} {image.shape}, expected uint8 "
                                             f"{shape[1:]}")
                        f.write(np.ascontiguousarray(image).tobytes())
                        written += 1
            raw.flush()
            os.fsync(raw.fileno())
        if written != shape[0]:
            raise ValueError(f"samples.npz got {written} images, expected {shape[0]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
