"""`GET /metrics`: the server's figures in Prometheus' text format, in a registry of its own
(several apps in one process, as in the tests, keep their figures apart).

Gauges read the engine loop when scraped (queue depth, rows running, engines, images/s over the
last minute); the engine loop adds each finished image (latency, target passes, acceptance) and
each first partial image as they happen, from its own thread (prometheus_client is thread-safe)."""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_PASS_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SHARE_BUCKETS = tuple(i / 10 for i in range(1, 11))


class ServeMetrics:
    """The server's counters, gauges and histograms (`render` writes them all)."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float],
                 engines: Callable[[], float], window_s: float = 60.0):
        r = self.registry = CollectorRegistry()
        self.window_s = window_s
        self._finished = collections.deque()        # finish times within the window
        self._lock = threading.Lock()
        self._started = time.monotonic()
        Gauge("specdec_queue_depth", "Images accepted that wait for a row", registry=r).set_function(queue_depth)
        Gauge("specdec_rows_running", "Images decoding now (rows held)", registry=r).set_function(running)
        Gauge("specdec_engines", "Engines alive (one per method, options and sampling)",
              registry=r).set_function(engines)
        Gauge("specdec_images_per_second", "Images finished per second over the last minute",
              registry=r).set_function(self.images_per_s)
        self.images = Counter("specdec_images_finished", "Images finished", ["method"], registry=r)
        self.requests = Counter("specdec_requests", "Requests by outcome", ["outcome"], registry=r)
        self.passes = Histogram("specdec_target_passes_per_image", "Target passes an image took part in",
                                ["method"], buckets=_PASS_BUCKETS, registry=r)
        self.acceptance = Histogram("specdec_acceptance", "Share of an image's drafts kept",
                                    ["method"], buckets=_SHARE_BUCKETS, registry=r)
        self.latency = Histogram("specdec_image_latency_seconds", "From a request's acceptance to its image",
                                 ["method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_partial = Histogram("specdec_time_to_first_partial_seconds",
                                       "From a request's acceptance to its first partial image", ["method"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self._recent_latency = collections.deque(maxlen=64)

    def image_finished(self, method: str, latency_s: float, target_passes: int, acceptance: Optional[float]) -> None:
        now = time.monotonic()
        self.images.labels(method).inc()
        self.latency.labels(method).observe(latency_s)
        self.passes.labels(method).observe(target_passes)
        if acceptance is not None:
            self.acceptance.labels(method).observe(acceptance)
        with self._lock:
            self._finished.append(now)
            self._recent_latency.append(latency_s)

    def partial_sent(self, method: str, since_accepted_s: float) -> None:
        self.first_partial.labels(method).observe(since_accepted_s)

    def request_done(self, outcome: str) -> None:
        """outcome: ok, cancelled, rejected (429), invalid (4xx), failed (5xx)."""
        self.requests.labels(outcome).inc()

    def images_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._finished and self._finished[0] < now - self.window_s:
                self._finished.popleft()
            count = len(self._finished)
        return count / max(1e-3, min(self.window_s, now - self._started))

    def mean_latency_s(self) -> Optional[float]:
        """The mean latency of the last images (for Retry-After), None before the first."""
        with self._lock:
            recent = list(self._recent_latency)
        return sum(recent) / len(recent) if recent else None

    def render(self):
        """(body, content type) of a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics"]
