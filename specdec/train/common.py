"""Pieces every training script shares: arguments, seeding, threads, timing, logging."""
from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=None, help="folder holding the Fashion-MNIST IDX files")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the trained safetensors")
    p.add_argument("--seed", type=int, default=0)
    # One thread by default: on a small shared machine a 2-thread step is slower in wall time
    # (threads wait for each other at every op when the cores are busy).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the script's)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    return p


def setup(args) -> None:
    """Deterministic given the seed: seeds every RNG and fixes the thread count."""
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)


class Log:
    def __init__(self, name: str):
        self.name = name
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def cpu(self) -> float:
        """CPU seconds of this process (all threads): on a busy shared machine, wall time
        overstates the cost; cpu / threads is what the script costs on an idle one."""
        return time.process_time() - self.cpu_start

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {self.elapsed():7.1f}s wall {self.cpu():7.1f}s cpu] {msg}", flush=True)


def cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + np.cos(np.pi * min(1.0, t)))
