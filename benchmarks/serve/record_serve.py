"""`specdec serve` under load against `stream()` driven directly, per method and concurrency: the
server started as `specdec serve` on a free loopback port (one CPU thread), the load generator's
Poisson arrivals from K = concurrency clients, then the same load through `stream()` in this
process. Per cell: images/s, p50/p99 latency and time to first partial image, both ways. Written to
benchmarks/results/serve-<machine>-<stamp>.json (RESULTS.md's "Serving" table), with a Markdown
table on stdout.

    python benchmarks/serve/record_serve.py [--methods ar,mulo,ssd,sd+exact] [--concurrency 1,4,16]
        [--requests 32] [--rate 8] [--time-limit 120] [--compile]

A method written `name+exact` runs in exact mode (`specdec serve --exact`, `stream(..., exact=True)`:
the image is exact `ar`'s for its seed, the widths follow the load). `--compile` compiles both ways:
the server warms its engine up before it reports healthy (`specdec serve --compile`), and the
stream's engine is warmed up alike (`StreamingEngine.warm_up`), before the warm-up requests.

Every cell is bounded: `--requests` requests at most, `--time-limit` seconds of load at most, and
a server that does not come up within a minute (compiled: fifteen, its warm-up included) fails the
cell. Each engine first serves `--warmup` requests untimed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from direct import run_direct  # noqa: E402
from loadgen import LoadSpec, run_load  # noqa: E402
from script_args import count, ints, names, positive_float  # noqa: E402


class CellFailed(Exception):
    """A cell that measured nothing: its server did not come up, or served none of its requests."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process, limit_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CellFailed(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CellFailed("the server did not come up in time")


def variant(name: str) -> Tuple[str, bool]:
    """`--methods`' entry as (method, exact): `sd` or `sd+exact`."""
    method, _, mode = name.partition("+")
    return method, mode == "exact"


def variant_names() -> list:
    """What --methods takes: every method, and `name+exact` for those exact mode runs."""
    from specdec.decoding import EXACT_METHODS, METHODS

    return list(METHODS) + [f"{m}+exact" for m in EXACT_METHODS]


def check_served(summary: dict, way: str, concurrency: int) -> dict:
    """`summary` when `way` (the server, stream()) served some of its requests; its failures are
    counted in it and said here, and a cell that served none is no measurement."""
    if not summary["images"]:
        why = ", ".join(f"{n}: {reason}" for reason, n in summary["failures"].items())
        raise CellFailed(f"{way} at concurrency {concurrency} served none of its {summary['failed']} requests ({why})")
    if summary["failed"]:
        print(f"{way} at concurrency {concurrency}: {summary['failed']} request(s) failed {summary['failures']}",
              file=sys.stderr, flush=True)
    return summary


def label(method: str, exact: bool) -> str:
    return f"{method} (exact)" if exact else method


def served(method: str, concurrency: int, spec: LoadSpec, warmup: int, partial_every: int, *, exact: bool = False,
           compile: bool = False) -> dict:
    """The load against `specdec serve` in a process of its own."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specdec.cli", "serve", "--method", method, "--concurrency", str(concurrency),
               "--port", str(port), "--threads", "1", "--partial-every", str(partial_every),
               "--max-queue", str(max(64, spec.requests)), "--quiet"]
    command += ["--exact"] * exact + ["--compile"] * compile
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, process, limit_s=900.0 if compile else 60.0)   # (a compiled server warms up first)
        if warmup:
            asyncio.run(run_load(url, replace(spec, requests=warmup, seed=spec.seed + 1)))
        return check_served(asyncio.run(run_load(url, spec))["summary"], f"specdec serve --method {method}",
                            concurrency)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def direct(method: str, concurrency: int, spec: LoadSpec, warmup: int, partial_every: int, *, exact: bool = False,
           compile: bool = False) -> dict:
    """The same load through `stream()` in this process (a fresh engine, warmed up alike)."""
    import torch

    from specdec.decoding import stream
    from specdec.models import default

    torch.set_num_threads(1)
    family = default()
    engine = stream(method, family, concurrency=concurrency, exact=exact, compile=compile)
    if compile:
        engine.warm_up(0)        # (what `specdec serve --compile` does before it takes requests)
    if warmup:
        run_direct(engine, family, replace(spec, requests=warmup, seed=spec.seed + 1), partial_every)
    return check_served(run_direct(engine, family, spec, partial_every)["summary"], f"stream({method!r})", concurrency)


def measure_cell(method: str, exact: bool, concurrency: int, args) -> dict:
    """One row: the load against `specdec serve`, then through `stream()`."""
    spec = LoadSpec(requests=args.requests, clients=concurrency, rate=args.rate, partial_images=args.partial_images,
                    time_limit_s=args.time_limit)
    how = {"exact": exact, "compile": args.compile}
    return {"method": method, "exact": exact, "concurrency": concurrency,
            "server": served(method, concurrency, spec, args.warmup, args.partial_every, **how),
            "stream": direct(method, concurrency, spec, args.warmup, args.partial_every, **how)}


def _fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows) -> str:
    lines = ["| method | concurrency | images/s (server / stream) | p50 latency s | p99 latency s | "
             "p50 first partial s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, d = r["server"], r["stream"]
        lines.append(f"| `{label(r['method'], r.get('exact', False))}` | {r['concurrency']} | "
                     f"{_fmt(s['images_per_s'], 2)} / "
                     f"{_fmt(d['images_per_s'], 2)} | {_fmt(s['latency_p50_s'])} / {_fmt(d['latency_p50_s'])} | "
                     f"{_fmt(s['latency_p99_s'])} / {_fmt(d['latency_p99_s'])} | "
                     f"{_fmt(s['first_partial_p50_s'])} / {_fmt(d['first_partial_p50_s'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", type=names(variant_names(), "method"), default="ar,mulo,ssd",
                   help="methods, and name+exact for exact mode (ar, sd, sjd)")
    p.add_argument("--concurrency", type=ints(1, what="concurrency"), default="1,4,16")
    p.add_argument("--requests", type=count(1), default="32")
    p.add_argument("--rate", type=positive_float, default="8.0", help="Poisson arrivals per second")
    p.add_argument("--partial-images", type=count(0), default="1")
    p.add_argument("--partial-every", type=count(1), default="4")
    p.add_argument("--warmup", type=count(0), default="2")
    p.add_argument("--time-limit", type=positive_float, default="120.0", help="seconds of load per cell, at most")
    p.add_argument("--compile", action="store_true", help="compiled passes, in the server and in stream()")
    args = p.parse_args(argv)
    from bench_helpers import device_description
    from run import machine_tag

    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    try:
        for method, exact in map(variant, args.methods):
            for concurrency in args.concurrency:
                rows.append(measure_cell(method, exact, concurrency, args))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    except CellFailed as e:     # (no record: its cells would not be the ones the command line names)
        sys.exit(f"record_serve.py: {e}; no record written")
    record = {"kind": "specdec-serve", "datetime": started.isoformat(), "machine": device_description(),
              "command": "python benchmarks/serve/record_serve.py " + " ".join(argv or sys.argv[1:]),
              "threads": 1, "rate": args.rate, "requests": args.requests, "warmup": args.warmup,
              "compile": args.compile, "rows": rows}      # (RESULTS.md: the newest eager and compiled runs)
    out_dir = os.path.join(os.path.dirname(HERE), "results")     # benchmarks/results, with every benchmark's
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"serve-{machine_tag()}-{started.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
