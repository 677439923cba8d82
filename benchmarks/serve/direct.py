"""The load of `loadgen.LoadSpec` driven straight through `specdec.decoding.stream` in one process:
the same arrivals, the same cap on requests in flight, the same seeds and images, and partial
images looked for as the server does (every `partial_every` steps, the first once the image is
1 / (partial_images + 1) formed, its pixels rendered). What the server adds over this is HTTP,
the engine loop's hand-offs and PNG encoding."""
from __future__ import annotations

import time
from collections import deque
from typing import Dict

from loadgen import ABANDONED, NOT_SENT, LoadSpec, Timing, summarize


def _first_partials(engine, waiting: Dict[int, Timing], started: float, spec: LoadSpec, grid, size) -> None:
    from specdec.serve.render import formed, partial_pixels

    for partial in engine.partials():
        timing = waiting.get(partial.tag)
        if timing is None or timing.first_partial_s is not None:
            continue
        if formed(partial, grid) * (spec.partial_images + 1) >= 1:
            if partial_pixels(partial, engine.tokenizer, grid, size) is not None:
                timing.first_partial_s = time.perf_counter() - started - timing.sent_s


def run_direct(engine, family, spec: LoadSpec, partial_every: int = 4) -> dict:
    """Serve `spec`'s requests with `engine` (`stream(method, family, concurrency=...)`) in this
    process. The engine is left idle for the next run: run the warm-up on the engine that is timed
    after it, as the server does, since a compiled engine's graphs are its own."""
    from specdec.decoding.results import decode_images

    import torch

    grid = tuple(family.target.grid)
    size = tuple(decode_images(torch.zeros(1, *grid, dtype=torch.long), engine.tokenizer).shape[-2:])
    arrivals = deque(enumerate(spec.arrivals()))
    waiting: Dict[int, Timing] = {}
    timings, steps = [], 0
    started = time.perf_counter()
    while (arrivals or waiting) and time.perf_counter() - started < spec.time_limit_s:
        now = time.perf_counter() - started
        while arrivals and arrivals[0][1] <= now and len(waiting) < spec.clients:
            i, _ = arrivals.popleft()
            body = spec.body(i)
            engine.submit(int(body["prompt"]), 0, seed=body["seed"], tag=i)
            waiting[i] = Timing(i, now)
        if not waiting:
            time.sleep(max(0.0, arrivals[0][1] - now))
            continue
        for image in engine.step():
            timing = waiting.pop(image.tag)
            timing.latency_s, timing.status = time.perf_counter() - started - timing.sent_s, 200
            timings.append(timing)
        steps += 1
        if spec.partial_images and steps % partial_every == 0:
            _first_partials(engine, waiting, started, spec, grid, size)
    engine.close()
    # (what the time limit cut off is counted as failed, as the load generator counts it)
    for timing in waiting.values():
        timing.error = ABANDONED
    timings += list(waiting.values()) + [Timing(i, None, error=NOT_SENT) for i, _ in arrivals]
    return {"summary": summarize(timings, time.perf_counter() - started), "steps": steps}


__all__ = ["run_direct"]
