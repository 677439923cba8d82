"""The settings that decide a run's images, recorded in DIR/config.json and compared when a
command is run again against the same directory: method, its options after defaults, seed,
sampling, compiled or eager, exact mode, conditioning, device type, a hash of the models'
weights, and under a token budget each image's share of it. A difference is an error naming
each value that differs ("options.tau"); the number of images may grow (a longer run of the
same settings extends the first one: image i does not depend on N) and shrink only to images
not done yet (an interrupted run asked for too many).

Batch size, world size and threads are not settings of the images (image i is keyed by the seed
and i alone) and may change between runs; under a token budget (--max-tokens-per-pass) the
batch size or concurrency sets the share, which must stay the same.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Dict, Iterable, List, Tuple

import torch

from specdec.ops.dispatch import resolve
from specdec.sample.plan import SampleError

#: Bumped when the directory layout or the meaning of a recorded setting changes (2: options are
#: the method's options dataclass, compile a setting of its own).
FORMAT = 2

#: Family fields whose weights can change a decoded image.
MODEL_FIELDS = ("target", "drafter", "sd_drafter", "ssd_heads", "tokenizer", "upsampler")


def weights_hash(modules: Dict[str, torch.nn.Module]) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) of the named modules:
    the same on any device, and different if any weight differs."""
    h = hashlib.sha256()
    for name in sorted(modules):
        for key, t in sorted(modules[name].state_dict().items()):
            t = t.detach().cpu().contiguous()
            h.update(f"{name}.{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def family_modules(family) -> Dict[str, torch.nn.Module]:
    get = (lambda k: family.get(k)) if isinstance(family, dict) else (lambda k: getattr(family, k, None))
    found = {}
    for name in MODEL_FIELDS:
        m = get(name)
        if isinstance(m, torch.nn.Module):
            found[name] = m
    return found


def _jsonable(value):
    """Options as JSON (tuples become lists, anything else its repr) so they compare after a round trip."""
    return json.loads(json.dumps(value, default=repr))


#: Sampling fields added after runs were first recorded, with their defaults: left out of the
#: record at those defaults, so that a run recorded before they existed still resumes.
_LATER_SAMPLING_FIELDS = {"cfg_interval": -1, "cfg_rule": "always"}


def _sampling_record(sampling) -> dict:
    record = dataclasses.asdict(sampling)
    for name, default in _LATER_SAMPLING_FIELDS.items():
        if record.get(name) == default:
            record.pop(name)
    return _jsonable(record)


def make_settings(*, method: str, options, run, conditioning: dict, device: torch.device, model_hash: str,
                  num: int) -> dict:
    """options: the method's options dataclass; run: the RunSettings (seed, sampling and compile
    decide the images; batch size does not)."""
    record = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    record = {k: _sampling_record(v) if dataclasses.is_dataclass(v) else v for k, v in record.items()}
    return {"format": FORMAT, "method": method, "options": _jsonable(record), "seed": run.seed,
            "sampling": _sampling_record(run.sampling), "compile": run.compile, **_jsonable(conditioning),
            "device_type": device.type, "model_sha256": model_hash, "num": num,
            # (recorded only when set, so that a run recorded before exact mode or token shares
            # existed still resumes; one recorded then under a budget is refused: its share is not
            # known) Under a token budget each image's share, the budget over the batch size or
            # concurrency, decides how it speculates, and so its tokens outside exact mode.
            **({"exact": True} if run.exact else {}),
            # The kernel backend, where it is not the device's own (SPECDEC_BACKEND, or a build
            # without its kernels): attention rounds differently on each, which moves a token now
            # and then. (Not recorded for the device's own, so that earlier runs still resume.)
            **({"backend": backend} if (backend := resolve(run.backend, device)) != device.type else {}),
            **({"token_share": run.token_share} if run.token_share is not None and not run.exact else {})}


#: Keys that may differ between a directory and a new command.
FREE = {"num"}


def differences(recorded: dict, wanted: dict) -> List[str]:
    """The settings that differ, each named down to the value that differs ("options.tau",
    "prompts[3].n"), `FREE` keys aside."""
    return [path for path, _, _ in _differing(recorded, wanted)]


def _differing(recorded, wanted, prefix: str = "") -> List[Tuple[str, object, object]]:
    """(path, recorded value, wanted value) of each value that differs (`differences`)."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        keys = sorted(set(recorded) | set(wanted), key=str)
        return [d for k in keys if prefix or k not in FREE
                for d in _differing(recorded.get(k), wanted.get(k), f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(recorded, list) and isinstance(wanted, list) and len(recorded) == len(wanted):
        return [d for i, (a, b) in enumerate(zip(recorded, wanted)) for d in _differing(a, b, f"{prefix}[{i}]")]
    return [] if recorded == wanted else [(prefix, recorded, wanted)]


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_against(recorded: dict, wanted: dict, out_dir: str, last_done: int = -1) -> dict:
    """The settings to record for this run: `wanted`, whose num may differ from the recorded one
    (a longer run extends the first: image i does not depend on N), but not fall to or below an
    image index already done (`last_done`: samples.npz would no longer cover the images/ the
    directory holds). Raises SampleError naming every setting that differs."""
    diff = _differing(recorded, wanted)
    if diff:
        detail = "; ".join(f"{k}: {_short(there)} there, {_short(now)} now" for k, there, now in diff)
        hint = (" (the token share is --max-tokens-per-pass over --batch-size or --concurrency)"
                if any(k == "token_share" for k, _, _ in diff) else "")
        raise SampleError(f"--out {out_dir} holds a run with other settings ({detail}){hint}; "
                          "rerun with the same settings to resume it, or choose a new --out")
    if wanted["num"] <= last_done:
        raise SampleError(f"--num {wanted['num']}: --out {out_dir} already holds image {last_done} (of the "
                          f"{recorded.get('num')} it was started with); a run may only shrink to the images not "
                          "yet done (take the first images of its samples.npz instead)")
    return wanted


def check_ranks_agree(per_rank: Iterable[dict]) -> None:
    """Every rank must decode with the same settings (same weights on every node, for one)."""
    per_rank = list(per_rank)
    for rank, s in enumerate(per_rank[1:], 1):
        diff = differences(per_rank[0], s)
        if diff:
            raise SampleError(f"rank {rank} differs from rank 0 in {', '.join(diff)} "
                              "(is every node running the same code and weights?)")
