"""Fashion-MNIST from IDX files, with no network.

The files are looked up, in order, in `--data DIR`, `$SPECDEC_FASHION_MNIST`, the folder the
Debian package `dataset-fashion-mnist` installs (asked from dpkg, then the usual path).
Both the plain and the gzipped IDX names are accepted.
"""
from __future__ import annotations

import gzip
import os
import struct
import subprocess
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
NUM_CLASSES = len(CLASS_NAMES)
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}
_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
# IDX type codes (the third byte of the magic number) -> numpy dtype, big-endian on disk.
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into an array of its declared shape and type."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValueError(f"{path}: expected {expected} bytes of data for shape {dims}, found {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str, array: np.ndarray) -> None:
    """Write an uint8 array as an IDX file (gzipped when the name ends in .gz); used by tests."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _debian_dirs() -> list:
    dirs = []
    try:
        out = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True, text=True, timeout=10)
        for line in out.stdout.splitlines():
            if line.endswith("train-images-idx3-ubyte.gz") or line.endswith("train-images-idx3-ubyte"):
                dirs.append(os.path.dirname(line))
    except (OSError, subprocess.SubprocessError):
        pass
    dirs.append(_DEBIAN_DIR)
    return dirs


def _find_file(dirs: list, stem: str) -> Optional[str]:
    for d in dirs:
        for name in (stem, stem + ".gz"):
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    return None


def find_data_dir(data_dir: Optional[str] = None) -> str:
    """The folder holding the Fashion-MNIST IDX files; a clear error when there is none."""
    dirs = [data_dir] if data_dir else []
    if not data_dir and os.environ.get("SPECDEC_FASHION_MNIST"):
        dirs.append(os.environ["SPECDEC_FASHION_MNIST"])
    if not data_dir:
        dirs += _debian_dirs()
    for d in dirs:
        if _find_file([d], "train-images-idx3-ubyte") is not None:
            return d
    raise FileNotFoundError(
        "Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...) not found in "
        f"{dirs}; install the Debian package dataset-fashion-mnist or pass --data DIR")


def load_split(split: str = "train", data_dir: Optional[str] = None):
    """(images uint8 [N, 28, 28], labels int64 [N]) of one split ("train" or "test")."""
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    d = find_data_dir(data_dir)
    prefix = _SPLIT_PREFIX[split]
    img_path = _find_file([d], f"{prefix}-images-idx3-ubyte")
    lab_path = _find_file([d], f"{prefix}-labels-idx1-ubyte")
    if img_path is None or lab_path is None:
        raise FileNotFoundError(f"{split} split of Fashion-MNIST incomplete in {d}")
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"{d}: images {images.shape} and labels {labels.shape} do not match")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def to_model_images(images_u8: torch.Tensor, size: int = 32) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float [N, 1, size, size] in [-1, 1]: zero-padded to 32, then
    area-downsampled when a smaller size (the 16x16 drafter's) is asked for, or up-sampled
    bilinearly when a larger one (the 32x32-token family's 64x64: the images up-sampled 2x, their
    padding with them) is."""
    x = images_u8.float().div(127.5).sub(1.0).unsqueeze(1)
    pad = (32 - x.shape[-1]) // 2
    x = F.pad(x, (pad, 32 - x.shape[-1] - pad, pad, 32 - x.shape[-2] - pad), value=-1.0)
    if size < 32:
        x = F.interpolate(x, size=(size, size), mode="area")
    elif size > 32:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    return x
