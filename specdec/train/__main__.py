"""python -m specdec.train {vq,classifier,target,drafter,sd_drafter,ssd,upsampler,
                           target32,sd_drafter32,ssd32,upsampler32,all} [options]

Trains the embedded families on Fashion-MNIST into specdec/weights/ (or --out): the 16x16-token
family, and the 32x32-token family in its grid32/ subfolder (the *32 scripts).
`all [--jobs N]` runs every script, N at a time (default 2, one per core of the machine the
family is sized for), each as soon as the scripts it needs are done, and prints each one's wall
time. Every script uses one torch thread by default, so two jobs fill a 2-core machine.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

from specdec.train.gpt_training import RECIPES as GPT_RECIPES, train_recipe

# What each script reads that another one writes: the GPTs and the up-sampler need the tokenizer,
# the SSD heads need the target. The GPTs' shapes and schedules are gpt_training.RECIPES; the
# other scripts are modules of this package.
NEEDS: Dict[str, tuple] = {
    "vq": (),
    "classifier": (),
    "target": ("vq",),
    "drafter": ("vq",),
    "sd_drafter": ("vq",),
    "ssd": ("target",),
    "upsampler": ("vq",),          # MuLo-SD's learned up-sampler
    # The 32x32-token family (weights/grid32/): the same VQ, the 16x16 target as its drafter.
    "target32": ("vq",),
    "sd_drafter32": ("vq",),
    "ssd32": ("target32",),
    "upsampler32": ("vq",),
}
SCRIPTS = tuple(NEEDS)
#: Scripts that are another one's with arguments of their own (the 32x32 family's heads and up-sampler).
VARIANTS = {"ssd32": ("ssd", ["--grid", "32"]), "upsampler32": ("upsampler", ["--grid", "32"])}
# Longest first among the ready ones, so the critical paths (vq -> target32 -> ssd32, vq -> target
# -> ssd) start early.
_LONGEST_FIRST = ("target32", "sd_drafter32", "target", "upsampler32", "upsampler", "sd_drafter", "drafter", "vq",
                  "ssd32", "ssd", "classifier")


def run_one(name: str, argv: List[str]) -> None:
    """Script `name` with `argv`; a bad flag, file or value is one line naming it (exit 2)."""
    program, sys.argv[0] = sys.argv[0], f"python -m specdec.train {name}"     # (what argparse's usage names)
    try:
        if name in GPT_RECIPES:
            train_recipe(name, argv)
        else:
            module, extra = VARIANTS.get(name, (name, []))
            importlib.import_module(f"specdec.train.{module}").main(extra + list(argv))
    except (ValueError, OSError) as e:
        print(f"specdec.train {name}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv[0] = program


def schedule(names: Sequence[str], jobs: int, start: Callable[[str], object],
             poll_seconds: float = 0.5) -> Dict[str, float]:
    """Run `names` at most `jobs` at a time, each once its NEEDS are done. `start(name)` returns a
    Popen-like object (poll() -> None while running, else the exit code). Returns wall seconds
    per script; raises RuntimeError naming the first script that fails."""
    pending = sorted(names, key=_LONGEST_FIRST.index)
    running, done, times = {}, set(), {}
    try:
        _run_in_order(pending, running, done, times, jobs, start, poll_seconds)
    finally:     # (a failure, Ctrl-C or SIGTERM: no script goes on writing weights after `all` stopped)
        for proc, _ in running.values():
            proc.terminate()
    return times


def _run_in_order(pending: list, running: dict, done: set, times: dict, jobs: int, start, poll_seconds: float):
    names = set(pending)
    while pending or running:
        for name in [n for n in pending if all(d in done or d not in names for d in NEEDS[n])]:
            if len(running) >= jobs:
                break
            pending.remove(name)
            running[name] = (start(name), time.perf_counter())
        if not running:
            raise RuntimeError(f"cannot order {pending}: their inputs are never produced")
        time.sleep(poll_seconds)
        for name, (proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[name]
            if rc != 0:
                raise RuntimeError(f"training script {name!r} failed with exit code {rc}")
            done.add(name)
            times[name] = time.perf_counter() - t0


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCRIPTS + ("all",):
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    if name != "all":
        run_one(name, rest)
        return
    jobs, rest = _all_flags(rest)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # (so that `schedule` stops its scripts)
    t0 = time.perf_counter()
    try:
        times = schedule(SCRIPTS, jobs, lambda n: subprocess.Popen([sys.executable, "-m", "specdec.train", n, *rest]))
    except RuntimeError as e:
        raise SystemExit(f"specdec.train all: error: {e}") from None
    for n, t in times.items():
        print(f"{n:12s} {t:7.1f} s")
    print(f"{'wall':12s} {time.perf_counter() - t0:7.1f} s with {jobs} job(s)")


def _all_flags(rest: List[str]):
    """(jobs, the flags every script gets) of `all`'s flags: --jobs N and the flags every script
    shares (common.base_parser's); another script's own flag would fail in the scripts without it."""
    from specdec.train.common import base_parser

    shared = base_parser("")
    parser = argparse.ArgumentParser(prog="python -m specdec.train all", parents=[shared], add_help=False,
                                     conflict_handler="resolve", allow_abbrev=False)
    parser.add_argument("--jobs", type=int, default=2, help="scripts run at once")
    args = parser.parse_args(rest)
    if args.jobs < 1:
        parser.error(f"--jobs must be an int >= 1, got {args.jobs}")
    forwarded = list(rest)
    if "--jobs" in forwarded:
        i = forwarded.index("--jobs")
        forwarded = forwarded[:i] + forwarded[i + 2:]
    return args.jobs, [a for a in forwarded if not a.startswith("--jobs=")]


if __name__ == "__main__":
    main()
