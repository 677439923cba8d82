"""Decoding in batches: `run_batches` splits the conditions into batches, gives each batch an
`Engine` (its images' streams, runners and statistics), times each batch and joins the
statistics; the checks of a decoder's common arguments (the model's protocol, the conditions)
happen here, once per call."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from specdec.decoding.engine import Engine
from specdec.decoding.continuous import ContinuousEngine, Requests, decode_continuous
from specdec.decoding.results import DecodeResult, DecodeStats, decode_images
from specdec.decoding.rolling import RollingEngine, decode_rolling
from specdec.decoding.streams import ImageStreams
from specdec.models.conditions import is_prompts
from specdec.settings import RunSettings


def check_grid_model(model, name: str = "model") -> None:
    for attr in ("grid", "vocab_size", "prefix_len", "new_cache", "prefill", "forward_tokens"):
        if not hasattr(model, attr):
            raise ValueError(f"{name} does not implement the ARImageModel protocol (no `{attr}`)")


def check_classes(model, classes):
    """Class ids as an int64 tensor [B], range-checked; a `Prompts` batch passes as it is."""
    if is_prompts(classes):
        return classes
    if not isinstance(classes, torch.Tensor):
        classes = torch.as_tensor(classes)
    if classes.dim() != 1 or classes.dtype not in (torch.int32, torch.int64) or classes.numel() == 0:
        raise ValueError(f"classes must be a non-empty 1-D int tensor, got {tuple(classes.shape)} {classes.dtype}")
    n = getattr(model, "num_classes", None)
    if n is not None and (int(classes.min()) < 0 or int(classes.max()) >= n):
        raise ValueError(f"classes must lie in [0, {n}), got [{int(classes.min())}, {int(classes.max())}]")
    return classes.long()


def run_batches(method: str, model, conditions, decode_batch: Callable, run: RunSettings,
                tokenizer=None, *, same_passes: bool = False, rolling: bool = False) -> DecodeResult:
    """Decode `conditions` in batches of `run.batch_size`: `decode_batch(conditions[i:i+b], engine)
    -> tokens [b, H*W]`, where `engine` (specdec.decoding.engine.Engine) holds the batch's round
    state: one random stream per image (`ImageStreams(run.seed, first_index + i ..)`), its runners
    and its statistics, which it completes when the batch ends. Image i depends only on (seed,
    first_index + i), whatever the batch size: a run of N images split into calls with
    `first_index` set to each call's offset gives the same images as one call. batch_size=1 is
    the latency setting speculative decoding is for. With `run.concurrency` set, class-conditional
    decodes run under continuous batching instead (`specdec.decoding.continuous`: each image in a
    slot of its own, refilled as images finish; the same images). Each batch is timed; the grids are decoded
    to images with `tokenizer` (not timed); preview grids a method decoded itself (the engine's
    `previews`) become the result's `preview`.

    `same_passes`: every image takes the same passes whatever it draws (`ar`, `zipar`; every
    method at a token share of one token, where each makes plain AR steps). Slots then have
    nothing to gain: they would all be refilled at the same steps, so a decode given
    `concurrency` runs in lockstep batches of that many images, the same passes without the
    per-image work of the slots (the same images: each depends on its seed and index only).

    `rolling`: `decode_batch` refills its rows when `engine.rolling` is set (`sd`, `lantern`), so a
    decode given `concurrency` runs one rolling batch of that many rows (`specdec.decoding.rolling`:
    a finished row takes the next request at the round's end; the per-round work is made once for
    all rows) instead of an image per slot."""
    check_grid_model(model, "target")
    H, W = model.grid
    if isinstance(conditions, Requests):
        # (the run says how many images decode at once: what their token share is taken over)
        run = dataclasses.replace(run, concurrency=run.concurrency or run.batch_size, batch_size=1)
        # (at a share of one token the methods make plain AR steps, which the slots batch)
        kind = RollingEngine if rolling and run.token_share != 1 else ContinuousEngine
        return kind(method, decode_batch, run, (H, W), run.concurrency, tokenizer,
                    check=lambda c: check_classes(model, c))
    conditions = check_classes(model, conditions)
    if run.concurrency is not None:
        lockstep = same_passes or run.token_share == 1 or is_prompts(conditions) or run.concurrency == 1
        if not lockstep:
            decode = decode_rolling if rolling else decode_continuous
            return decode(method, conditions, decode_batch, run, (H, W), tokenizer)
        # Lockstep batches of `concurrency` images: when every image takes the same passes
        # (above), and for prompt-conditioned models (prompts of different lengths would need a
        # prefix length per cache row; the caches have none yet). One slot is one image at a
        # time: the same decode without the engine's hand-overs.
        run = dataclasses.replace(run, batch_size=run.concurrency, concurrency=None)
    total = DecodeStats(method)
    grids, previews = [], []
    n, step = conditions.shape[0], run.batch_size
    for i in range(0, n, step):
        batch = conditions[i:i + step]
        engine = Engine(method, run, ImageStreams(run.seed, range(run.first_index + i,
                                                                  run.first_index + i + batch.shape[0])), (H, W))
        # Decoding is inference: without no_grad a model whose parameters require grad (a
        # transformers checkpoint, say) would record autograd graphs in eager passes, and
        # torch.compile would trace a training graph (a backward beside every compiled pass).
        start = time.perf_counter()
        with torch.no_grad():
            grids.append(decode_batch(batch, engine).view(-1, H, W).cpu())
        stats = engine.finish()
        stats.wall_s = time.perf_counter() - start
        total.merge(stats)
        if engine.previews is not None:
            previews.append(engine.previews.cpu().long())
        if run.progress is not None:
            run.progress(min(i + step, n))
    tokens = torch.cat(grids)
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, torch.cat(previews) if previews else None)


__all__ = ["check_classes", "check_grid_model", "run_batches"]
