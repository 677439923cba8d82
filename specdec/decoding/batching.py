"""How a decode runs: `run_rows` on the scheduler (`specdec.decoding.scheduler`: `ar`, `sd`,
`lantern`, `sjd`, `zipar`), `run_batches` in lockstep batches or an image per slot (MuLo-SD and
SSD, until they are policies over rows too); the checks of a decoder's common arguments (the
model's protocol, the conditions) happen here, once per call."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from specdec.decoding.engine import Engine
from specdec.decoding.continuous import ContinuousEngine, Requests, decode_continuous
from specdec.decoding.results import DecodeResult, DecodeStats, decode_images
from specdec.decoding.scheduler import Scheduler
from specdec.decoding.streaming import RowStream
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


def run_rows(method: str, model, conditions, make_policy: Callable, run: RunSettings, tokenizer=None):
    """Decode `conditions` on the scheduler, `make_policy(engine)` the method's policy over its
    rows: `run.concurrency` rows, each refilled as soon as its image is done; else lockstep
    batches of `run.batch_size` (rows refilled once all are free). Image i depends only on (seed,
    first_index + i). Prompts start together in groups of that many (a cache holds one prefix
    length for all its rows). Given `Requests()` it returns the streaming engine (`RowStream`)
    instead. The grids are decoded to images with `tokenizer` (not timed)."""
    check_grid_model(model, "target")
    if isinstance(conditions, Requests):
        run = dataclasses.replace(run, concurrency=run.concurrency or run.batch_size, batch_size=1)
        return RowStream(method, make_policy, run, model.grid, run.concurrency, tokenizer,
                         check=lambda c: check_classes(model, c))
    conditions = check_classes(model, conditions)
    n, rows = conditions.shape[0], run.concurrency or run.batch_size
    prompts = is_prompts(conditions)
    groups = [(i, min(i + rows, n)) for i in range(0, n, rows)] if prompts else [(0, n)]
    finished, total = {}, DecodeStats(method)
    start = time.perf_counter()
    for lo, hi in groups:
        scheduler = Scheduler(method, make_policy, run, model.grid, min(rows, hi - lo),
                              refill=run.concurrency is not None)
        for i in range(lo, hi):
            scheduler.submit(conditions[i:i + 1] if prompts else conditions[i], run.first_index + i)
        with torch.no_grad():   # (inference: see run_batches)
            while not scheduler.idle:
                for image in scheduler.step():
                    finished[image.index] = image
                    if run.progress is not None:
                        run.progress(len(finished))
        total.passes_made += scheduler.passes_made
        if run.compile:
            total.compile_s.append(scheduler.take_compile_s())
    wall_s = time.perf_counter() - start
    total.extend([finished[i].stats for i in sorted(finished)])
    total.wall_s = wall_s
    H, W = model.grid
    images = [finished[i] for i in sorted(finished)]
    tokens = torch.stack([image.tokens for image in images]).view(-1, H, W)
    previews = [image.preview for image in images]
    preview = torch.stack(previews) if all(p is not None for p in previews) else None
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, preview)


def run_batches(method: str, model, conditions, decode_batch: Callable, run: RunSettings,
                tokenizer=None) -> DecodeResult:
    """Decode `conditions` in batches of `run.batch_size`: `decode_batch(conditions[i:i+b], engine)
    -> tokens [b, H*W]`, where `engine` (specdec.decoding.engine.Engine) holds the batch's round
    state: one random stream per image (`ImageStreams(run.seed, first_index + i ..)`), its runners
    and its statistics, which it completes when the batch ends. Image i depends only on (seed,
    first_index + i), whatever the batch size. With `run.concurrency` set, class-conditional
    decodes run under continuous batching instead (`specdec.decoding.continuous`: each image in a
    slot of its own, refilled as images finish; the same images), except at a token share of one
    token, where every image makes plain AR steps and slots have nothing to gain: lockstep
    batches of that many images. Each batch is timed; the grids are decoded to images with
    `tokenizer` (not timed); preview grids a method decoded itself (the engine's `previews`)
    become the result's `preview`."""
    check_grid_model(model, "target")
    H, W = model.grid
    if isinstance(conditions, Requests):
        # (the run says how many images decode at once: what their token share is taken over)
        run = dataclasses.replace(run, concurrency=run.concurrency or run.batch_size, batch_size=1)
        return ContinuousEngine(method, decode_batch, run, (H, W), run.concurrency, tokenizer,
                                check=lambda c: check_classes(model, c))
    conditions = check_classes(model, conditions)
    if run.concurrency is not None:
        lockstep = run.token_share == 1 or is_prompts(conditions) or run.concurrency == 1
        if not lockstep:
            return decode_continuous(method, conditions, decode_batch, run, (H, W), tokenizer)
        # Lockstep batches of `concurrency` images: at a share of one token (above), and for
        # prompt-conditioned models (prompts of different lengths would need a prefix length per
        # cache row; the caches have none yet). One slot is one image at a time: the same decode
        # without the engine's hand-overs.
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


__all__ = ["check_classes", "check_grid_model", "run_batches", "run_rows"]
