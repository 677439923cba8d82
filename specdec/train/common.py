"""Pieces every training script shares: arguments and their checks, seeding, threads, timing,
logging."""
from __future__ import annotations

import argparse
import math
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


#: Flags of `own_generations.add_model_arguments` (and a script's own, `model_only=`) that only a
#: model of the user's takes: given without --model they would be ignored.
MODEL_FLAGS = ("prompts", "vq", "gpt_size", "vq_size", "grid_size", "dtype", "trust_pickle", "device", "cfg_scale",
               "height", "width")


def check_args(parser: argparse.ArgumentParser, args, model_only: tuple = ()) -> None:
    """The flags' values, before any work: a ValueError naming the first flag at fault (the
    entry point prints it as one line). Counts are ints >= 1 (0 was read as "the default"),
    numbers finite, --seed a seed, --out a folder that can be written (made now; with --model
    given, never the package's own), and the flags of a model of one's own only with --model."""
    from specdec.cli_flags import check_device
    from specdec.settings import check_seed
    from specdec.user_inputs import writable_folder

    values = vars(args)
    for name in ("steps", "batch_size", "limit", "samples"):
        if values.get(name) is not None and values[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {values[name]}")
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    check_seed(args.seed, "--seed")
    if values.get("model") is None:
        given = [n for n in MODEL_FLAGS + tuple(model_only) if n in values and values[n] != parser.get_default(n)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for a model of your own (--model PATH); the embedded "
                             "family trains on the CPU with the script's own settings")
    else:
        if os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
            raise ValueError("--out is required with --model: the default, the package's weights folder, holds the "
                             "embedded family's own weights")
        check_device(values["device"])
    writable_folder(args.out, "--out")


def setup(args) -> None:
    """Deterministic given the seed: seeds every RNG and fixes the thread count."""
    from specdec.cli_flags import set_threads

    set_threads(args.threads)
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


def check_loss(loss: torch.Tensor, step: int) -> float:
    """The loss as a float, a ValueError when it is not finite: weights trained on it would be
    NaN, saved with no error (called where the loss is logged: a NaN persists once it appears)."""
    value = loss.item()
    if not math.isfinite(value):
        raise ValueError(f"the loss is {value} at step {step}: stopped before saving (check the learning settings "
                         "and the data)")
    return value


def cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + np.cos(np.pi * min(1.0, t)))
