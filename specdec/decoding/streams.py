"""Randomness as an input: one random stream per image.

All randomness of a decode goes through uniforms drawn from one CPU generator per image (image i
of a run seeded s always draws from `image_generator(s, i)`), so a decode is a pure function of
(models, conditions, settings, seed), identical on every kernel backend (the ops are bit-exact
against their reference given the uniforms), and image i's tokens do not depend on the batch it
was decoded in.
"""
from __future__ import annotations

import torch

from specdec.decoding.uploads import to_device


def image_generator(seed: int, index: int = 0) -> torch.Generator:
    """The generator of image `index` of a run seeded `seed`: images are reproducible one by one."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    mixed = (seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 62)
    return torch.Generator().manual_seed(mixed)


class ImageStreams:
    """The random streams of the images of one batch, one CPU generator per image.

    A draw of shape [B * m, ...] gives image b the rows [b * m, (b + 1) * m) from its own
    generator, so every image consumes its stream exactly as it would decoded alone: with one
    image this is `torch.rand(shape, generator=image_generator(seed, index))`, the stream of
    the single-image decoders. CPU generators make the numbers the same on every device."""

    def __init__(self, seed: int, indices):
        self.indices = list(indices)
        self.generators = [image_generator(seed, i) for i in self.indices]
        self.paused = [False] * len(self.generators)

    def __len__(self) -> int:
        return len(self.generators)

    def _draw(self, b: int, shape) -> torch.Tensor:
        if self.paused[b]:
            return torch.zeros(shape, dtype=torch.float32)
        return torch.rand(shape, generator=self.generators[b], dtype=torch.float32)

    def rand(self, shape) -> torch.Tensor:
        shape = tuple(shape)
        n = len(self.generators)
        if n == 1:
            return self._draw(0, shape)
        if not shape or shape[0] % n:
            raise ValueError(f"a draw for {n} images needs a leading dimension divisible by {n}, got {shape}")
        per = (shape[0] // n,) + shape[1:]
        return torch.cat([self._draw(b, per) for b in range(n)])

    def only(self, active) -> "ImageStreams":
        """The same streams with the images where `active` [B] is False paused: their draws are
        zeros and leave their streams where they are. For a phase that some images of a batch have
        finished while others go on (SSD's row 0), so that a finished image continues its stream
        afterwards exactly where it would decoded alone."""
        view = object.__new__(ImageStreams)
        view.indices, view.generators = self.indices, self.generators
        view.paused = [p or not bool(a) for p, a in zip(self.paused, active)]
        return view

    def rand_where(self, mask: torch.Tensor) -> torch.Tensor:
        """One uniform per set entry of mask [B, L] (row-major), image b's from its own stream:
        the draw an image would make alone for its own set entries."""
        if len(self.generators) == 1:
            return self._draw(0, (int(mask.sum()),))
        return self.rand_counts(mask.reshape(mask.shape[0], -1).sum(1).tolist())

    def rand_counts(self, counts) -> torch.Tensor:
        """counts[b] uniforms from image b's stream, concatenated: `rand_where` for a caller that
        already has the per-image counts on the host (no read-back)."""
        if len(counts) != len(self.generators):
            raise ValueError(f"{len(counts)} counts for {len(self.generators)} images")
        return torch.cat([self._draw(b, (c,)) for b, c in enumerate(counts)])

    def rand_padded(self, counts, width: int, *, right: bool = False) -> torch.Tensor:
        """[B, width]: row b holds counts[b] uniforms from image b's stream, then zeros (padding
        that draws nothing; `right=True`: the zeros first): for a pass whose images judge windows
        of different lengths."""
        if len(counts) != len(self.generators):
            raise ValueError(f"{len(counts)} counts for {len(self.generators)} images")
        rows = [(self._draw(b, (c,)), torch.zeros(width - c)) for b, c in enumerate(counts)]
        return torch.stack([torch.cat(row[::-1] if right else row) for row in rows])

    def image(self, b: int) -> "ImageStreams":
        """The stream of image b alone (shared state: drawing from it advances image b here too)."""
        one = object.__new__(ImageStreams)
        one.indices, one.generators, one.paused = [self.indices[b]], [self.generators[b]], [self.paused[b]]
        return one


def uniforms(gen, shape, device) -> torch.Tensor:
    """float32 uniforms in [0, 1) from `gen` (ImageStreams or a CPU torch.Generator), moved to
    `device` (same numbers anywhere)."""
    if isinstance(gen, ImageStreams):
        return to_device(gen.rand(shape), device)
    return to_device(torch.rand(shape, generator=gen, dtype=torch.float32), device)


def step_uniforms(gen, steps: int, per_step: int, device) -> torch.Tensor:
    """[steps, per_step] float32: row s holds the uniforms that the s-th of `steps` successive
    `uniforms(gen, (per_step,), device)` calls would return, drawn at once (a loop of steps then
    draws nothing per step; each image's stream is consumed exactly as step by step)."""
    if isinstance(gen, ImageStreams):
        n = len(gen)
        if per_step % n:
            raise ValueError(f"a draw for {n} images needs a count divisible by {n}, got {per_step}")
        per = per_step // n     # each image draws `per` numbers a step, step after step
        u = gen.rand((n * steps * per,)).view(n, steps, per)
        return to_device(u.transpose(0, 1).reshape(steps, per_step), device)
    return to_device(torch.rand((steps, per_step), generator=gen, dtype=torch.float32), device)


__all__ = ["ImageStreams", "image_generator", "step_uniforms", "uniforms"]
