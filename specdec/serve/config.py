"""The server's settings (`ServeConfig`) and how each serving process builds its model family
(`ModelSpec`): the same spec goes to every uvicorn process and every Ray Serve replica, which
build their own family from it rather than receiving one (models do not travel between nodes)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from specdec.decoding import check_method
from specdec.decoding.batching import not_exact
from specdec.settings import RunSettings, check_int


@dataclass(frozen=True)
class ServeConfig:
    """What one serving process runs: the default method and its options, the rows per engine,
    the bounds that protect it, and the run settings every engine shares.

    A request may name another method, sampling or options (extra body fields); each distinct
    combination gets an engine of its own (`concurrency` rows each), at most `max_engines` at once."""

    method: str = "mulo"                   #: the method of requests that name none
    concurrency: int = 8                   #: rows (images decoding at once) per engine
    model_name: str = "specdec-embedded"   #: the id `GET /v1/models` lists and `model` must name
    #: seed: the seed of the generator that picks the seeds of requests that give none; sampling:
    #: the default sampling (None: the family's own); exact: the default of requests that do not say
    #: (`exact` in the body); backend, compile, max_tokens_per_pass: every engine's. batch_size and
    #: concurrency are ignored (each engine has `concurrency` rows).
    run: RunSettings = RunSettings()
    preset: Optional[str] = None           #: the default method's preset
    options: Dict[str, object] = field(default_factory=dict)   #: the default method's options
    #: images accepted and not finished, beyond the rows of one engine: more is a 429
    max_queue: int = 64
    max_n: int = 10                        #: the most images one request may ask for
    max_body_bytes: int = 64 * 1024        #: larger request bodies are a 413
    max_engines: int = 4                   #: engines (method, sampling and options) alive at once
    #: a partial image is looked for every this many engine steps (each look is one host read)
    partial_every: int = 4
    batch_invariant: bool = False          #: the engine loop under `specdec.numerics.batch_invariant()`
    #: before its first request the default engine decodes throwaway images in the patterns a load
    #: meets (`StreamingEngine.warm_up`), so that a compiled server makes its graphs while /health
    #: says "warming_up" (`specdec serve --compile` sets it; --no-warm-up does not)
    warm_up: bool = False
    drain_timeout_s: float = 60.0          #: at shutdown, how long accepted requests may still run
    keepalive_s: float = 5.0               #: a comment line on a quiet event stream this often

    def __post_init__(self):
        check_method(self.method)
        if self.run.exact and (why := not_exact(self.method)):
            raise ValueError(f"exact mode: the default method {why} (specdec serve --method)")
        check_int(self.concurrency, "concurrency", 1)
        check_int(self.max_queue, "max_queue", 0)
        check_int(self.max_n, "max_n", 1)
        check_int(self.max_body_bytes, "max_body_bytes", 256)
        check_int(self.max_engines, "max_engines", 1)
        check_int(self.partial_every, "partial_every", 1)
        if self.max_n > self.concurrency + self.max_queue:
            # (a request of max_n images could never be accepted)
            raise ValueError(f"max_n {self.max_n} exceeds concurrency + max_queue "
                             f"({self.concurrency} + {self.max_queue})")
        for name in ("drain_timeout_s", "keepalive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def capacity(self) -> int:
        """Images accepted and not yet finished, at most (429 beyond)."""
        return self.concurrency + self.max_queue

    def replace(self, **changes) -> "ServeConfig":
        """This config with `changes`: its own fields, or fields of its run settings (seed,
        sampling, backend, compile, max_tokens_per_pass); anything else is a ValueError."""
        own = {f.name for f in dataclasses.fields(self)}
        run_fields = {f.name for f in dataclasses.fields(RunSettings)}
        unknown = sorted(set(changes) - own - run_fields)
        if unknown:
            raise ValueError(f"unknown serve setting(s) {', '.join(unknown)}; settings: {', '.join(sorted(own))}, "
                             f"and the run settings {', '.join(sorted(run_fields))}")
        run = {k: changes.pop(k) for k in list(changes) if k not in own}
        if run:
            changes["run"] = dataclasses.replace(changes.get("run", self.run), **run)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelSpec:
    """How a serving process builds its family: `factory`, an import path "module:callable"
    returning a family (a test's tiny family), or else `flags`, the model flags of `specdec serve`
    (those of `specdec generate`: --grid, --device, --threads, or --model PATH with --vq, --drafter,
    ...), read by the CLI's own loaders. Picklable, for Ray."""

    factory: Optional[str] = None
    flags: Optional[Dict[str, object]] = None

    def load(self) -> Tuple[object, Dict[str, object]]:
        """(the family, the models to give every engine whose method takes them: those of
        --drafter, --heads, --upsampler for --model)."""
        if self.factory is not None:
            threads = (self.flags or {}).get("threads")
            if threads is not None:
                from specdec.cli_flags import set_threads

                set_threads(threads)
            module, _, name = self.factory.partition(":")
            if not name:
                raise ValueError(f"a family factory is 'module:callable', got {self.factory!r}")
            return getattr(importlib.import_module(module), name)(), {}
        from specdec.cli_flags import embedded_family, load_model

        args = argparse.Namespace(**(self.flags or {}))
        if getattr(args, "model", None) is None:
            return embedded_family(args), {}
        family, models = load_model(args)
        return family, dict(models)


__all__ = ["ModelSpec", "ServeConfig"]
