"""python -m specdec.train {vq,classifier,target,drafter,sd_drafter,ssd,upsampler,all} [options]

Trains the embedded default family on Fashion-MNIST into specdec/weights/ (or --out).
`all` runs every script in dependency order and prints each one's wall time.
"""
from __future__ import annotations

import importlib
import sys
import time

from specdec.train.gpt_training import RECIPES as GPT_RECIPES, train_recipe

# Dependency order: the GPTs need the tokenizer, the SSD heads need the target. The GPTs' shapes and
# schedules are gpt_training.RECIPES; the other scripts are modules of this package.
SCRIPTS = ("vq", "classifier", "target", "drafter", "sd_drafter", "ssd", "upsampler")  # upsampler: MuLo-SD, needs the tokenizer


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCRIPTS + ("all",):
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    names = SCRIPTS if name == "all" else (name,)
    times = {}
    for n in names:
        t0 = time.perf_counter()
        if n in GPT_RECIPES:
            train_recipe(n, rest)
        else:
            importlib.import_module(f"specdec.train.{n}").main(rest)
        times[n] = time.perf_counter() - t0
    if len(names) > 1:
        for n, t in times.items():
            print(f"{n:12s} {t:7.1f} s")
        print(f"{'total':12s} {sum(times.values()):7.1f} s")


if __name__ == "__main__":
    main()
