"""Randomness as an input: one random stream per image.

A decode is a pure function of (models, conditions, settings, seed, backend): given the same
distributions every backend draws the same tokens (docs/design.md, "Randomness is explicit";
docs/engine.md, "Batches and randomness"). `ImageStreams` is the one stream type of the decoders: a single image
is a batch of one.
"""
from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch

from specdec.decoding.uploads import to_device
from specdec.settings import check_seed


def image_generator(seed: int, index: int = 0) -> torch.Generator:
    """The generator of image `index` of a run seeded `seed`: images are reproducible one by one.
    torch's CPU generator keeps 32 bits of its seed, so there are 2**32 streams: for one index,
    each seed of [0, 2**32) (`check_seed`) has its own, and so has each index below 2**32 for one
    seed (the map below is odd in both)."""
    check_seed(seed)
    return torch.Generator().manual_seed((seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 62))


_MASK64 = 2 ** 64 - 1


def _mix64(z: int) -> int:
    """splitmix64's step: a bijection of 64-bit ints that spreads every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def image_key(seed: int, index: int) -> int:
    """The key of image `index` of a run seeded `seed` for position-keyed draws (exact mode: the
    noise of its token at position t is a function of (key, t) alone), a non-negative int64.
    Unlike the generators' seeds it mixes both ints through a 64-bit bijection, so two images
    share a key only by a 2**-63 accident."""
    return _mix64(_mix64(seed & _MASK64) ^ (index & _MASK64)) >> 1


class ImageStreams:
    """The random streams of the images of one batch, one CPU generator per image.

    A draw of shape [B * m, ...] gives image b the rows [b * m, (b + 1) * m) from its own
    generator, so every image consumes its stream exactly as it would decoded alone: with one
    image this is `torch.rand(shape, generator=image_generator(seed, index))`. CPU generators make
    the numbers the same on every device. A draw of a different count per image (`rand_counts`,
    `rand_padded`) is how an image that has finished a phase draws nothing while others go on."""

    def __init__(self, seed: int, indices: Sequence[int], *, exact: bool = False):
        """`exact`: the images draw their tokens with position-keyed noise (`keys`; `draws.draw`)
        rather than from their generators."""
        self.seed = seed
        self.exact = exact
        self.generators = [image_generator(seed, i) for i in indices]
        self.keys = [image_key(seed, i) for i in indices]   #: each image's `image_key`
        self._key_tensors: dict = {}      # `key_tensor`, by device (dropped when a row restarts)

    def restart(self, b: int, index: int, seed: Optional[int] = None) -> None:
        """Row b now draws from the start of image `index`'s stream (of a run seeded `seed`, default
        these streams'): a scheduler row taking the next request (`specdec.decoding.scheduler`)."""
        seed = self.seed if seed is None else seed
        self.generators[b] = image_generator(seed, index)
        self.keys[b] = image_key(seed, index)
        self._key_tensors = {}

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s image and its stream, where it stands, to row `dst` (the scheduler keeping
        its busy rows low)."""
        for values in (self.generators, self.keys):
            values[dst] = values[src]
        self._key_tensors = {}

    def key_tensor(self, device) -> torch.Tensor:
        """`keys` as int64 [B] on `device`, uploaded once until a row restarts."""
        found = self._key_tensors.get(str(device))
        if found is None:
            found = self._key_tensors[str(device)] = to_device(self.keys, device, torch.long)
        return found

    def rows(self, rows: Sequence[int]) -> "ImageStreams":
        """The streams of `rows` alone, as a batch of those images; they share the generators, so
        each goes on drawing where the other left off."""
        some = copy.copy(self)
        some.generators = [self.generators[b] for b in rows]
        some.keys = [self.keys[b] for b in rows]
        some._key_tensors = {}
        return some

    def __len__(self) -> int:
        return len(self.generators)

    def rand(self, shape) -> torch.Tensor:
        """float32 uniforms of `shape`, whose leading dimension is split evenly between the images."""
        shape = tuple(shape)
        n = len(self.generators)
        if not shape or shape[0] % n:
            raise ValueError(f"a draw for {n} images needs a leading dimension divisible by {n}, got {shape}")
        return self.rand_counts([math.prod(shape) // n] * n).view(shape)

    def rand_counts(self, counts: Sequence[int]) -> torch.Tensor:
        """counts[b] uniforms from image b's stream, concatenated (host counts: no read-back)."""
        self._check(counts)
        out = torch.empty(sum(counts), dtype=torch.float32)
        # `uniform_` into a view of `out`: the numbers of `torch.rand(row.numel(), generator=...)`
        # (which is `uniform_` on a new tensor), without a tensor per image to copy together.
        for b, row in enumerate(out.split(list(counts))):
            row.uniform_(generator=self.generators[b])
        return out

    def rand_padded(self, counts: Sequence[int], width: int, *, right: bool = False) -> torch.Tensor:
        """[B, width]: row b holds counts[b] uniforms from image b's stream, then zeros that draw
        nothing (`right=True`: the zeros first), for images judging windows of different lengths."""
        self._check(counts)
        out = torch.zeros(len(counts), width)
        for b, (row, c) in enumerate(zip(out, counts)):
            if c:
                (row[width - c:] if right else row[:c]).uniform_(generator=self.generators[b])
        return out

    def _check(self, counts) -> None:
        if len(counts) != len(self.generators):
            raise ValueError(f"{len(counts)} counts for {len(self.generators)} images")


__all__ = ["ImageStreams", "image_generator", "image_key"]
