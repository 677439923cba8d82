"""python -m specdec.train {vq,classifier,target,drafter,sd_drafter,ssd,upsampler,
                           target32,sd_drafter32,ssd32,upsampler32,all} [options]

Trains the embedded families on Fashion-MNIST into specdec/weights/ (or --out): the 16x16-token
family, and the 32x32-token family in its grid32/ subfolder (the *32 scripts).
`all [--jobs N]` runs every script, N at a time (default 2, one per core of the machine the
family is sized for), each as soon as the scripts it needs are done, and prints each one's wall
time. Every script uses one torch thread by default, so two jobs fill a 2-core machine.
"""
from __future__ import annotations

import importlib
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
    if name in GPT_RECIPES:
        train_recipe(name, argv)
    else:
        module, extra = VARIANTS.get(name, (name, []))
        importlib.import_module(f"specdec.train.{module}").main(extra + list(argv))


def schedule(names: Sequence[str], jobs: int, start: Callable[[str], object],
             poll_seconds: float = 0.5) -> Dict[str, float]:
    """Run `names` at most `jobs` at a time, each once its NEEDS are done. `start(name)` returns a
    Popen-like object (poll() -> None while running, else the exit code). Returns wall seconds
    per script; raises RuntimeError naming the first script that fails."""
    pending = sorted(names, key=_LONGEST_FIRST.index)
    running, done, times = {}, set(), {}
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
                for other, _ in running.values():
                    other.terminate()
                raise RuntimeError(f"training script {name!r} failed with exit code {rc}")
            done.add(name)
            times[name] = time.perf_counter() - t0
    return times


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCRIPTS + ("all",):
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    if name != "all":
        run_one(name, rest)
        return
    jobs = 2
    if "--jobs" in rest:
        i = rest.index("--jobs")
        jobs = int(rest[i + 1])
        rest = rest[:i] + rest[i + 2:]
        if jobs < 1:
            raise SystemExit("--jobs must be >= 1")
    t0 = time.perf_counter()
    times = schedule(SCRIPTS, jobs, lambda n: subprocess.Popen([sys.executable, "-m", "specdec.train", n, *rest]))
    for n, t in times.items():
        print(f"{n:12s} {t:7.1f} s")
    print(f"{'wall':12s} {time.perf_counter() - t0:7.1f} s with {jobs} job(s)")


if __name__ == "__main__":
    main()
