"""How a decode runs: `run_rows`, every method on the scheduler (`specdec.decoding.scheduler`),
after checking a decoder's common arguments (the model's protocol, the conditions) once per call."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from specdec.decoding.results import DecodeResult, DecodeStats, decode_images
from specdec.decoding.scheduler import Scheduler
from specdec.decoding.streaming import Requests, StreamingEngine
from specdec.models.conditions import is_prompts
from specdec.settings import RunSettings


#: The methods that can run in exact mode (`RunSettings.exact`): those whose tokens follow the
#: target's distribution exactly. LANTERN, ZipAR, MuLo-SD and SSD keep tokens the target would
#: not have drawn, so no noise can make their image `ar`'s.
EXACT_METHODS = ("ar", "sd", "sjd")


def not_exact(method: str) -> Optional[str]:
    """Why `method` cannot run in exact mode (None: it can), for every caller's error message."""
    if method in EXACT_METHODS:
        return None
    return f"{method} is not lossless and cannot be exact; exact methods: {', '.join(EXACT_METHODS)}"


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
    """Decode `conditions` (class ids, or a `Prompts` batch) on the scheduler with the method's
    policy `make_policy(engine)`: `run.concurrency` rows, each refilled as its image is done, else
    lockstep batches of `run.batch_size`. Image i depends only on (seed, first_index + i). Given
    `Requests(...)`, returns a `StreamingEngine` instead. `tokenizer` makes images (untimed)."""
    check_grid_model(model, "target")
    if run.exact and (why := not_exact(method)):
        raise ValueError(f"exact: {why}")
    if isinstance(conditions, Requests):
        return StreamingEngine(method, make_policy, run, model.grid, run.concurrency, tokenizer, conditions.condition)
    conditions = check_classes(model, conditions)
    n, rows = conditions.shape[0], run.concurrency or run.batch_size
    prompts = is_prompts(conditions)
    finished = {}
    start = time.perf_counter()
    scheduler = Scheduler(method, make_policy, run, model.grid, min(rows, n), refill=run.concurrency is not None)
    try:        # (whatever ends the decode, its compiled runners go back to their models: `Engine.release`)
        for i in range(n):
            scheduler.submit(conditions[i:i + 1] if prompts else conditions[i], run.first_index + i)
        # Inference: autograd off, for the reason `StreamingEngine.step` gives.
        with torch.no_grad():
            while not scheduler.idle:
                for image in scheduler.step():
                    finished[image.index] = image
                    if run.progress is not None:
                        run.progress(len(finished))
    finally:
        scheduler.engine.release()
    compile_s = [scheduler.take_compile_s()] if run.compile else []
    total = DecodeStats(method, passes_made=scheduler.passes_made, wall_s=time.perf_counter() - start,
                        compile_s=compile_s)
    images = [finished[i] for i in sorted(finished)]
    total.extend([image.stats for image in images])
    tokens = torch.stack([image.tokens for image in images])
    previews = [image.preview for image in images]
    preview = torch.stack(previews) if all(p is not None for p in previews) else None
    return DecodeResult(tokens, decode_images(tokens, tokenizer), total, preview)


__all__ = ["EXACT_METHODS", "check_classes", "check_grid_model", "not_exact", "run_rows"]
