"""`specdec compare`'s work: every method on the same classes and seeds, one table with passes,
wall time, speed-ups against `ar` of the same run, and the quality columns."""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

import torch

from specdec import decoding
from specdec.decoding.results import concat_results
from specdec.settings import SEEDS, RunSettings

COLUMNS = ("method", "target_forwards", "step_compression", "wall_s", "speedup", "class_accuracy", "fd")


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(rows: List[dict], fd_real: Optional[float] = None) -> str:
    head = (f"{'method':<9} {'target fwd/img':>14} {'step compr.':>11} {'wall s/img':>10} {'speed-up':>9} "
            f"{'class acc':>9} {'FD-classifier':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<9} {_fmt(r['target_forwards'], '14.1f')} {_fmt(r['step_compression'], '10.2f')}x "
                     f"{_fmt(r['wall_s'], '10.3f')} {_fmt(r['speedup'], '8.2f')}x {_fmt(r['class_accuracy'], '9.3f')} "
                     f"{_fmt(r['fd'], '13.2f')}")
    if fd_real is not None:
        lines.append(f"(FD-classifier of as many real held-out images: {fd_real:.2f}; it is not FID)")
    return "\n".join(lines)


#: Images each method decodes per turn in `run_compare`.
COMPARE_TURN = 10


def method_of(label: str) -> str:
    """The method of a compare label: `mulo+zipar` is `mulo` (a variant with options of its own)."""
    return label.split("+", 1)[0]


def check_labels(methods: List[str], options: Dict[str, dict]) -> None:
    """--methods names each label once, each a method or METHOD+NAME, and --set only those."""
    if not methods:
        raise ValueError("--methods names no method; choose among " + ", ".join(decoding.METHODS))
    for m in methods:
        decoding.check_method(method_of(m))
        if m.endswith("+"):
            raise ValueError(f"--methods: {m!r} has no variant name (METHOD+NAME, such as mulo+zipar)")
        if methods.count(m) > 1:
            raise ValueError(f"--methods names {m} twice (a variant is METHOD+NAME, such as mulo+zipar)")
    for m in options:
        if m not in methods:
            raise ValueError(f"--set {m}.KEY=VALUE: --methods does not run {m} (it runs {', '.join(methods)})")


def run_compare(fam, methods: List[str], num_images: int, run: RunSettings, options: Dict[str, dict], *,
                out_dir: Optional[str] = None, warmup: bool = True, progress=None, turn: int = COMPARE_TURN):
    """Every method on the same classes and seeds. The methods take turns, `turn` images each, so
    that a slow spell of a shared machine (such spells last minutes) falls on all methods alike
    instead of on whichever ran through it. Image i of every method depends only on (seed, i), so
    the turns change no token. `run`: the settings every method runs with (`run.progress` is not
    used: `progress(images done of all methods)` is); `options[m]`: method m's options. A method
    may be given twice under labels `METHOD+NAME` (`mulo+zipar`), each with its own options: a
    variant measured beside the default in the same run."""
    from specdec import images, quality

    check_labels(methods, options)
    if num_images < 2:
        raise ValueError(f"--num-images must be >= 2 (the Frechet distance needs two images), got {num_images}")
    n_classes = fam.target.num_classes
    classes = torch.arange(num_images) % n_classes
    run = dataclasses.replace(run, progress=None)
    if warmup:   # first-call costs (allocator, kernel caches, compilation of a batch's shapes) are not the method's
        for m in methods:
            warm = dataclasses.replace(run, seed=(run.seed + 10_000) % SEEDS)   # (seeds are 32-bit)
            width = run.concurrency or run.batch_size
            decoding.decode(method_of(m), fam, classes[:width], run=warm, **options.get(m, {}))
    parts: Dict[str, list] = {m: [] for m in methods}
    done = 0
    for start in range(0, num_images, turn):
        for m in methods:
            chunk = dataclasses.replace(run, first_index=start)
            parts[m].append(decoding.decode(method_of(m), fam, classes[start:start + turn], run=chunk,
                                            **options.get(m, {})))
            done += parts[m][-1].tokens.shape[0]
            if progress is not None:
                progress(done)
    results, rows = {}, []
    fd_real = None
    for m in methods:
        out = concat_results(m, parts.pop(m))
        q = quality.evaluate(getattr(fam, "evaluator", None), out.images, classes)
        fd_real = q["fd_real"] if q["fd_real"] is not None else fd_real
        s = out.stats
        results[m] = out
        rows.append({"method": m, "target_forwards": s.target_forwards_per_image, "step_compression": None,
                     "wall_s": s.wall_s / s.images, "speedup": None, "class_accuracy": q["class_accuracy"],
                     "fd": q["fd"], "draft_forwards": s.draft_forwards / s.images,
                     "tokens_per_target_pass": s.tokens_per_target_pass,
                     # (target_forwards counts a pass shared by a batch for each image; this, once)
                     "passes_made": s.passes_made / s.images})
        if out_dir and out.images is not None:
            images.save_grid(out.images, os.path.join(out_dir, f"{m}.png"), nrow=min(10, num_images))
        if out_dir and method_of(m) == "mulo" and out.images is not None and s.acceptance_maps:
            # MuLo-SD judges each batch once: its acceptance maps are one per image, in order (none
            # when a token budget of one per image left it plain AR steps)
            images.save_mulo_maps(out.images, torch.cat(s.acceptance_maps), s.method_stats.islands,
                                  os.path.join(out_dir, f"{m}_maps.png"))
    base = next((r for r in rows if r["method"] == "ar"), None)
    if base is not None:
        for r in rows:
            r["step_compression"] = base["target_forwards"] / r["target_forwards"]
            r["speedup"] = base["wall_s"] / r["wall_s"]
    return rows, results, fd_real


__all__ = ["COLUMNS", "COMPARE_TURN", "format_table", "run_compare"]
