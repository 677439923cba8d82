"""A bounded load generator for `specdec serve` on loopback: Poisson arrivals at `rate` requests/s,
at most `clients` requests in flight (K concurrent clients), `requests` in all, and a time limit
after which nothing more is sent and what is in flight is abandoned. Each request streams
(`partial_images`) so that one request gives both its time to first partial image and its latency.

    python benchmarks/serve/loadgen.py --url http://127.0.0.1:8000 --requests 32 --clients 4 --rate 8

Only loopback addresses are accepted: this is a benchmark of a server on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional
from urllib.parse import urlparse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/: script_args

from script_args import count, positive_float  # noqa: E402

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class LoadSpec:
    """What a run sends: how many requests, how they arrive, what each asks for."""

    requests: int = 32                 #: requests in all (one image each)
    clients: int = 4                   #: at most this many in flight (K concurrent clients)
    rate: float = 8.0                  #: Poisson arrivals per second
    seed: int = 0                      #: the arrivals' and the requests' seeds
    partial_images: int = 1            #: partial images asked per request (0: none; no time to first partial)
    classes: int = 10                  #: request i asks for class i % classes
    time_limit_s: float = 300.0        #: nothing is sent after this, in-flight requests are abandoned
    extra: dict = field(default_factory=dict)   #: more body fields (method, options)

    def arrivals(self) -> List[float]:
        """Each request's arrival time (s from the start): exponential gaps at `rate`."""
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in range(self.requests):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out

    def body(self, i: int) -> dict:
        return {"prompt": str(i % self.classes), "seed": (self.seed * 100_003 + i) % 2 ** 32, "stream": True,
                "partial_images": self.partial_images, **self.extra}


@dataclass
class Timing:
    """One request: when it was sent, its first partial image and its image (s from its send), or
    why it has no image (every request of a run is one of these: a failure is counted, not lost)."""

    index: int
    sent_s: Optional[float]            #: None: never sent (the time limit had passed)
    first_partial_s: Optional[float] = None
    latency_s: Optional[float] = None
    status: int = 0
    error: Optional[str] = None


NOT_SENT = "not sent: the time limit had passed"
ABANDONED = "abandoned at the time limit"


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"the load generator only targets this machine (127.0.0.1, localhost, ::1), got {host!r}")
    return url.rstrip("/")


def loopback_url(text: str) -> str:
    """--url: check_loopback as an argparse type (refused before anything is sent)."""
    try:
        return check_loopback(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


async def _one(client, timing: Timing, spec: LoadSpec) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/images/generations", json=spec.body(timing.index)) as r:
        timing.status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("event: image_generation.partial_image") and timing.first_partial_s is None:
                timing.first_partial_s = time.perf_counter() - sent
            elif line.startswith("event: image_generation.completed"):
                timing.latency_s = time.perf_counter() - sent


def outcome(index: int, task: asyncio.Task, timing: Optional[Timing]) -> Timing:
    """Request `index` as it ended (its task done or cancelled): its timing, with why it failed when
    it has no image."""
    if timing is None:
        return Timing(index, None, error=NOT_SENT)
    if timing.latency_s is not None:
        return timing
    if task.cancelled():
        timing.error = ABANDONED
    elif task.exception() is not None:       # (connection refused, a dropped stream, ...)
        timing.error = f"{type(task.exception()).__name__}: {task.exception()}"
    else:
        timing.error = f"HTTP {timing.status}" if timing.status != 200 else "the stream ended without its image"
    return timing


async def run_load(url: str, spec: LoadSpec) -> dict:
    """Send the load; returns the summary and every request's timing."""
    import httpx

    url = check_loopback(url)
    gate = asyncio.Semaphore(spec.clients)
    started = time.perf_counter()
    sent: Dict[int, Timing] = {}

    async def client_turn(client, i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
        async with gate:
            if time.perf_counter() - started > spec.time_limit_s:
                return
            sent[i] = Timing(i, time.perf_counter() - started)
            await _one(client, sent[i], spec)

    limits = httpx.Limits(max_connections=spec.clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=spec.time_limit_s, limits=limits) as client:
        tasks = [asyncio.ensure_future(client_turn(client, i, at)) for i, at in enumerate(spec.arrivals())]
        _, pending = await asyncio.wait(tasks, timeout=spec.time_limit_s)
        for task in pending:
            task.cancel()
        # (the cancelled tasks finish before the client closes, and their requests are counted)
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - started
    timings = [outcome(i, task, sent.get(i)) for i, task in enumerate(tasks)]
    return {"summary": summarize(timings, wall), "timings": [asdict(t) for t in timings]}


def percentile(values: List[float], q: float) -> Optional[float]:
    """The q-th percentile (nearest rank) of `values`, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def failures(timings: List[Timing]) -> Dict[str, int]:
    """How many requests failed, by why (the errors as reported)."""
    return dict(collections.Counter(t.error or "no image" for t in timings if t.latency_s is None))


def summarize(timings: List[Timing], wall_s: float) -> dict:
    """images/s over the run, latency and time to first partial image (p50, p99), in seconds; the
    requests without an image, failed, by why."""
    done = [t for t in timings if t.latency_s is not None]
    latency = [t.latency_s for t in done]
    first = [t.first_partial_s for t in done if t.first_partial_s is not None]
    end = max((t.sent_s + t.latency_s for t in done), default=wall_s)
    return {"images": len(done), "failed": len(timings) - len(done), "failures": failures(timings), "wall_s": end,
            "images_per_s": len(done) / end if end > 0 else 0.0,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "first_partial_p50_s": percentile(first, 50), "first_partial_p99_s": percentile(first, 99),
            "latency_mean_s": statistics.fmean(latency) if latency else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", type=loopback_url, default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=count(1), default="32")
    p.add_argument("--clients", type=count(1), default="4")
    p.add_argument("--rate", type=positive_float, default="8.0")
    p.add_argument("--partial-images", type=count(0), default="1")
    p.add_argument("--time-limit", type=positive_float, default="300.0")
    p.add_argument("--method", default=None, help="(the server refuses one it does not run: those requests fail)")
    args = p.parse_args(argv)
    spec = LoadSpec(requests=args.requests, clients=args.clients, rate=args.rate, partial_images=args.partial_images,
                    time_limit_s=args.time_limit, extra={"method": args.method} if args.method else {})
    summary = asyncio.run(run_load(args.url, spec))["summary"]
    print(json.dumps(summary, indent=2))
    if not summary["images"]:
        print(f"loadgen: every request failed ({', '.join(f'{n}: {why}' for why, n in summary['failures'].items())})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
