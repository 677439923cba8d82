"""`specdec sample`: decode N images across the ranks of a torchrun world into PNGs, then gather
them on rank 0 into samples.npz and stats.json.

    DIR/config.json                 the settings (compared when the command is run again)
    DIR/images/{i:06d}.png          image i (class ids), or with --prompts GenEval's layout:
    DIR/images/{p:05d}/metadata.jsonl, DIR/images/{p:05d}/samples/{s:04d}.png
    DIR/manifest/*.jsonl            one line per finished image (index, path, sha256, passes)
    DIR/stats/rank{r:04d}.json      each rank's statistics of the last run
    DIR/samples.npz                 uint8 [N, H, W, 3] under arr_0 (ADM evaluator layout)
    DIR/stats.json                  per rank and total: passes, wall time, images/s

Rank 0 alone reads the directory and decides what is left to do (then broadcasts it), so ranks
never disagree about it; each rank then writes only its own images and its own manifest file.
The directory must be one every node sees (a shared filesystem), as rank 0 reads all PNGs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from specdec import decoding
from specdec.decoding import stages
from specdec.decoding.batching import not_exact
from specdec.settings import INDICES, RunSettings
from specdec.user_inputs import writable_folder
from specdec.images import to_uint8
from specdec.sample import plan, settings, store
from specdec.sample.plan import Refused, SampleError
from specdec.progress import ProgressLine
from specdec.sample.world import World


@dataclass
class Request:
    method: str
    out_dir: str
    num: Optional[int] = None            #: None only with prompts (the file sets N)
    #: seed, sampling (None: the family's), batch size, compile; first_index and progress are the runner's
    run: RunSettings = field(default_factory=RunSettings)
    options: Dict[str, object] = field(default_factory=dict)
    classes: Optional[List[str]] = None  #: as typed: ids or class names
    prompts: Optional[str] = None        #: JSONL prompt file
    show_progress: bool = True


@dataclass
class Job:
    """A request resolved against a family: what to decode and the settings that decide it."""

    items: List[plan.Item]
    prompts: Optional[List[dict]]
    family: object
    options: object            #: the method's options dataclass, defaults filled in (recorded)
    run: RunSettings           #: with the sampling filled in
    settings: dict

    def decode(self, method: str, classes: torch.Tensor, first_index: int):
        run = dataclasses.replace(self.run, first_index=first_index)
        return decoding.decode(method, self.family, classes, run=run, **decoding.options_as_kwargs(self.options))


def _get(family, name):
    return family.get(name) if isinstance(family, dict) else getattr(family, name, None)


#: The run settings that `specdec sample` has no flag of its own for, and how to set them instead.
_NO_FLAG = {"first_index": "sample numbers the images itself (--num; a rerun resumes)",
            "progress": "sample shows its own progress", "backend": "set SPECDEC_BACKEND=cpu|cuda|triton|reference",
            "adaptive_width": "it is on in exact mode (--exact)",
            "sampling": "give it with the sampling flags (--cfg-scale, --temperature, --top-k, --top-p)"}


def resolve(family, req: Request, device: torch.device) -> Job:
    try:
        writable_folder(req.out_dir, "--out")   # (before any model work: a bad path costs no run)
    except ValueError as e:
        raise SampleError(str(e)) from None
    decoding.check_method(req.method)
    if req.run.exact and (why := not_exact(req.method)):
        raise SampleError(f"--exact: {why}")
    for name in decoding.api.RUN_FIELDS:
        if name in req.options:
            how = _NO_FLAG.get(name, "give it as --" + name.replace("_", "-"))
            raise SampleError(f"--set {name}: a run setting, not an option of {req.method}: {how}")
    try:
        # as `decoding.decode` resolves them: the family's sampling and option defaults included
        resolved = decoding.api.resolve(req.method, family, run=req.run, **req.options)
    except ValueError as e:
        raise SampleError(f"--set: {e}") from None
    if resolved.given:
        raise SampleError(f"--set {', '.join(sorted(resolved.given))}: a model, not an option of {req.method} "
                          "(sample decodes with the family's models)")
    options = resolved.options
    run = dataclasses.replace(resolved.run, progress=None, first_index=0)

    target = _get(family, "target")
    num_classes, names = target.num_classes, tuple(_get(family, "class_names") or ())
    # image i draws from stream i: a run takes indices below INDICES (a two-stage family's below
    # the indices its target stages draw from), checked before one item per image is made
    most = INDICES if _get(family, "preview") is None else stages.TARGET_STAGE_INDEX
    prompts = classes = None
    if req.prompts is not None:
        if req.classes is not None:
            raise SampleError("--classes and --prompts exclude each other (a prompt line names its class)")
        prompts = plan.read_prompts(req.prompts, num_classes, names)
        total = sum(p["n"] for p in prompts)
        if total > most:
            raise SampleError(f"--prompts {req.prompts} asks for {total} images; a run takes at most {most}")
        items = plan.prompt_items(prompts)
        if req.num is not None and req.num != len(items):
            raise SampleError(f"--num {req.num} differs from the {len(items)} images --prompts {req.prompts} asks for "
                              "(the sum of its \"n\"); leave --num out")
    else:
        if req.num is None:
            raise SampleError("--num is required (or --prompts FILE, whose lines give the number of images)")
        if isinstance(req.num, bool) or not isinstance(req.num, int) or not 1 <= req.num <= most:
            raise SampleError(f"--num must be an int in [1, {most}], got {req.num!r}")
        classes = plan.parse_classes(req.classes, num_classes, names)
        items = plan.class_items(req.num, classes, num_classes)

    model_hash = settings.weights_hash(settings.family_modules(family))
    wanted = settings.make_settings(method=req.method, options=options, run=run,
                                    conditioning=plan.describe_classes(classes, prompts), device=device,
                                    model_hash=model_hash, num=len(items))
    job = Job(items, prompts, family, options, run, wanted)
    _warm_up(job, req)
    return job


def _warm_up(job: Job, req: Request) -> None:
    """Decode one image and throw it away: an option value the method refuses (tau=-1) fails
    here, before config.json records it (a corrected rerun would then be refused as a changed
    setting), and first-call costs (allocator, kernel caches) stay out of the timings."""
    try:
        job.decode(req.method, torch.tensor([job.items[0].cls]), 0)
    except ValueError as e:
        raise SampleError(f"--set / sampling: {e}") from None


# ----------------------------------------------------------------------------------------------
# rank 0: what is left to do
# ----------------------------------------------------------------------------------------------

def _attempt_id() -> str:
    """Names this run's manifest files: sortable, and distinct across reruns."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"


def prepare(job: Job, out_dir: str, rank_settings: List[dict]):
    """Rank 0: check the directory against the settings (and the ranks against each other), lock
    it (`store.lock_run`), record the settings, and list the images not yet verifiably done.
    Returns (what to do, the lock: held until the run ends)."""
    settings.check_ranks_agree(rank_settings)
    # (a stranger's directory is refused before anything is written in it, the lock file included;
    # what a run killed while it wrote its first config.json leaves is no stranger's file)
    if _config(out_dir) is None and os.path.isdir(out_dir) and any(
            not store.is_temporary(name) and name != store.LOCK_FILE for name in os.listdir(out_dir)):
        raise SampleError(f"--out {out_dir} is not empty and holds no config.json of a sample run; choose a new --out")
    os.makedirs(out_dir, exist_ok=True)
    lock = store.lock_run(out_dir)
    try:
        return _record(job, out_dir), lock
    except BaseException:
        lock.close()
        raise


def _config(out_dir: str) -> Optional[dict]:
    try:
        return store.read_json(os.path.join(out_dir, "config.json"))
    except ValueError:
        raise SampleError(f"--out {out_dir}: config.json is not valid JSON; it is not a directory this "
                          "command can continue") from None


def _record(job: Job, out_dir: str) -> dict:
    """Under the lock: the directory as the run that held it last left it."""
    config_path, recorded = os.path.join(out_dir, "config.json"), _config(out_dir)
    records = store.read_manifest(out_dir)
    chosen = job.settings if recorded is None else settings.check_against(recorded, job.settings, out_dir,
                                                                           max(records, default=-1))
    # no process of this run has written yet: what killed processes left, and the statistics of
    # the ranks of an earlier run (a world of fewer ranks would leave some behind), go
    store.remove_temporaries(out_dir)
    store.remove_rank_stats(out_dir)
    store.atomic_write_json(config_path, chosen)
    if job.prompts is not None:
        for p, obj in enumerate(job.prompts):
            meta = {k: v for k, v in obj.items() if k != "n"}
            store.atomic_write(os.path.join(out_dir, plan.prompt_dir(p), "metadata.jsonl"),
                               (json.dumps(meta, sort_keys=True) + "\n").encode())
    pending = [it.index for it in job.items if store.verified(out_dir, records.get(it.index), it.path) is None]
    return {"pending": pending, "attempt": _attempt_id()}


# ----------------------------------------------------------------------------------------------
# every rank: decode its share
# ----------------------------------------------------------------------------------------------

def _decode_share(job: Job, req: Request, world: World, out_dir: str, todo: dict, bar: ProgressLine) -> dict:
    mine = plan.pieces(todo["pending"], world.size, world.rank, job.run.concurrency or job.run.batch_size)
    writer = store.ManifestWriter(store.manifest_path(out_dir, world.rank, todo["attempt"]))
    counter = store.LineCounter(out_dir, todo["attempt"])
    stats = {"rank": world.rank, "local_rank": world.local_rank, "host": socket.gethostname(), "images": 0,
             "target_forwards": 0, "draft_forwards": 0, "decode_s": 0.0}
    start = time.perf_counter()
    try:
        for first, count in mine:
            chunk = job.items[first:first + count]
            classes = torch.tensor([it.cls for it in chunk], dtype=torch.long)
            out = job.decode(req.method, classes, first)
            if out.images is None:
                raise SampleError(f"the family has no tokenizer: {req.method} decoded tokens but no images")
            pixels = to_uint8(out.images).numpy()
            for it, image in zip(chunk, pixels):
                data = store.png_bytes(image)
                store.atomic_write(os.path.join(out_dir, it.path), data)
                writer.add({"i": it.index, "path": it.path, "sha256": store.sha256(data), "class": it.cls})
            s = out.stats
            stats["images"] += count
            stats["target_forwards"] += s.target_forwards
            stats["draft_forwards"] += s.draft_forwards
            stats["decode_s"] += s.wall_s
            bar.update(counter())
    finally:
        writer.close()
    stats["wall_s"] = time.perf_counter() - start
    stats["images_per_s"] = stats["images"] / stats["wall_s"] if stats["wall_s"] > 0 else 0.0
    return stats


# ----------------------------------------------------------------------------------------------
# rank 0: gather
# ----------------------------------------------------------------------------------------------

def _verified_images(job: Job, out_dir: str):
    """Every image as uint8 [H, W, 3], in index order, each checked against its manifest hash
    (a failed check stops write_npz, which then leaves no samples.npz behind)."""
    records = store.read_manifest(out_dir)
    # A cheap look first (no reading), so that images a node wrote where rank 0 cannot see
    # them are reported before any work; the hashes are checked as the npz is written.
    missing = [it.index for it in job.items
               if it.index not in records or not os.path.exists(os.path.join(out_dir, it.path))]
    if missing:
        raise SampleError(f"{len(missing)} image(s) are missing after the run (first: {missing[0]}); is --out on a "
                          "filesystem every node shares? Rerun the command to redo them")
    for it in job.items:
        data = store.verified(out_dir, records[it.index], it.path)
        if data is None:
            raise SampleError(f"{it.path} does not match its manifest hash (changed during the run?); "
                              "rerun the command to redo it")
        yield store.png_rgb(data)


def gather(job: Job, out_dir: str, per_rank: List[dict], todo: dict, wall_s: float) -> dict:
    images = _verified_images(job, out_dir)
    first = next(images)
    shape = (len(job.items),) + first.shape

    def all_images():
        yield first
        yield from images

    t0 = time.perf_counter()
    store.write_npz(os.path.join(out_dir, "samples.npz"), all_images(), shape)
    decoded = sum(r["images"] for r in per_rank)
    total = {"images": decoded, "target_forwards": sum(r["target_forwards"] for r in per_rank),
             "draft_forwards": sum(r["draft_forwards"] for r in per_rank), "wall_s": wall_s,
             "images_per_s": decoded / wall_s if wall_s > 0 else 0.0,
             "target_forwards_per_image": sum(r["target_forwards"] for r in per_rank) / max(1, decoded)}
    summary = {"method": job.settings["method"], "num": len(job.items),
               "skipped_as_done": len(job.items) - len(todo["pending"]),
               "world_size": len(per_rank), "attempt": todo["attempt"], "npz_shape": list(shape),
               "npz_s": time.perf_counter() - t0, "total": total, "per_rank": per_rank}
    stats_path = os.path.join(out_dir, "stats.json")
    if decoded or not _describes(stats_path, summary):
        store.atomic_write_json(stats_path, summary)
    return summary


def _describes(stats_path: str, summary: dict) -> bool:
    """Whether an earlier run's stats.json describes the same set as this summary: a rerun that
    decoded nothing keeps the figures of the run that decoded it."""
    try:
        stats = store.read_json(stats_path)
    except ValueError:      # (damaged: written again)
        return False
    return isinstance(stats, dict) and stats.get("num") == summary["num"] and \
        stats.get("npz_shape") == summary["npz_shape"]


def run(family, req: Request, world: World, device: torch.device) -> Optional[dict]:
    """Decode the request's images on this rank's share; on rank 0 gather them and return the
    summary written to stats.json (None on the other ranks)."""
    out_dir = req.out_dir
    # Every rank checks its input; rank 0 reports the first problem any rank found, once.
    try:
        job, problem = resolve(family, req, device), None
    except SampleError as e:
        job, problem = None, str(e)
    reports = world.gather((None if job is None else job.settings, problem))
    todo, lock = None, None
    if world.is_main:
        failed = [(r, p) for r, (_, p) in enumerate(reports) if p is not None]
        try:
            if failed:
                rank, problem = failed[0]
                raise SampleError(problem if rank == 0 else f"rank {rank}: {problem}")
            todo, lock = prepare(job, out_dir, [s for s, _ in reports])
        except (SampleError, OSError) as e:
            todo = {"error": str(e)}
    try:
        todo = world.broadcast(todo)
        if "error" in todo:
            raise SampleError(todo["error"]) if world.is_main else Refused(todo["error"])
        return _decode_and_gather(job, req, world, todo)
    finally:
        if lock is not None:
            lock.close()


def _decode_and_gather(job: Job, req: Request, world: World, todo: dict) -> Optional[dict]:
    out_dir = req.out_dir
    done_before = len(job.items) - len(todo["pending"])
    bar = ProgressLine(len(job.items), done_before, enabled=req.show_progress and world.is_main)
    start = time.perf_counter()
    try:
        mine = _decode_share(job, req, world, out_dir, todo, bar)
        store.atomic_write_json(os.path.join(out_dir, store.STATS_DIR, f"rank{world.rank:04d}.json"),
                                dict(mine, attempt=todo["attempt"], world_size=world.size))
        per_rank = world.gather(mine)
        if world.is_main:
            bar.update(len(todo["pending"]), force=True)
    finally:
        bar.close()
    if not world.is_main:
        return None
    return gather(job, out_dir, per_rank, todo, time.perf_counter() - start)
