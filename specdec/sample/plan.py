"""What a `specdec sample` run generates: one item per global image index (its class and the PNG
it goes to), from class ids or a GenEval-style prompt file, and how the images still to do are
split among the ranks.

The global index i is the only thing an image's randomness depends on (with the seed), so any
split of the indices among ranks, batches or resumed runs gives the same images.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


class SampleError(ValueError):
    """Bad input or a directory that cannot be continued; the CLI prints it as one line."""


class Refused(SampleError):
    """Raised on ranks other than 0 when rank 0 refused the run: rank 0 prints the reason once."""


@dataclass(frozen=True)
class Item:
    index: int                     #: global image index (the randomness key)
    cls: int                       #: class id the image is conditioned on
    path: str                      #: PNG path relative to the output directory
    prompt: Optional[int] = None   #: prompt-file line (per-prompt layout only)


def flat_path(index: int) -> str:
    """ADM / LlamaGen-style flat folder: images/{i:06d}.png."""
    return f"images/{index:06d}.png"


def prompt_dir(prompt: int) -> str:
    """GenEval's layout: one folder per prompt holding metadata.jsonl and samples/."""
    return f"images/{prompt:05d}"


def prompt_path(prompt: int, sample: int) -> str:
    return f"{prompt_dir(prompt)}/samples/{sample:04d}.png"


def _class_id(value, num_classes: int, class_names: Sequence[str], where: str) -> int:
    """A class given as an id or as one of the family's class names (case-insensitive)."""
    if isinstance(value, bool):
        raise SampleError(f"{where}: class must be an id or a class name, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            value = int(text)
        else:
            names = {n.lower(): k for k, n in enumerate(class_names)}
            if text.lower() not in names:
                known = ", ".join(class_names) if class_names else "none (use ids)"
                raise SampleError(f"{where}: unknown class {value!r}; class names: {known}")
            return names[text.lower()]
    if not isinstance(value, int):
        raise SampleError(f"{where}: class must be an id or a class name, got {value!r}")
    if not 0 <= value < num_classes:
        raise SampleError(f"{where}: class ids must lie in [0, {num_classes}), got {value}")
    return value


def parse_classes(values: Optional[Sequence[str]], num_classes: int,
                  class_names: Sequence[str] = ()) -> Optional[List[int]]:
    """--classes 0 3 7 or --classes 0,3,7 (ids or class names) -> [0, 3, 7]; None when not given."""
    if values is None:
        return None
    parts = [p for v in values for p in str(v).split(",") if p.strip()]
    if not parts:
        raise SampleError("--classes: give at least one class id")
    return [_class_id(p, num_classes, class_names, "--classes") for p in parts]


def class_items(num: int, classes: Optional[List[int]], num_classes: int) -> List[Item]:
    """Image i gets classes[i % len(classes)], or class i % num_classes without --classes."""
    cycle = classes if classes is not None else list(range(num_classes))
    return [Item(i, cycle[i % len(cycle)], flat_path(i)) for i in range(num)]


#: Samples per prompt when a prompt-file line does not say (GenEval's own default).
DEFAULT_PER_PROMPT = 4


def read_prompts(path: str, num_classes: int, class_names: Sequence[str] = ()) -> List[dict]:
    """A JSONL prompt file, one object per line: {"class": id or name, "n": samples, ...}. Every
    other field is kept and written to the prompt folder's metadata.jsonl (as GenEval does with
    its prompt metadata). A line with only a text "prompt" needs a text-conditional model."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SampleError(f"--prompts: cannot read {path}: {e.strerror or e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {path}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SampleError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SampleError(f"{where}: expected a JSON object like {{\"class\": 7, \"n\": 4}}")
        if "class" not in obj:
            if "prompt" in obj:
                raise SampleError(f"{where}: text prompts need a text-conditional model (not available yet); "
                                  "this family is class-conditional: give {\"class\": id}")
            raise SampleError(f"{where}: no \"class\" field")
        n = obj.get("n", DEFAULT_PER_PROMPT)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SampleError(f"{where}: \"n\" must be an int >= 1, got {n!r}")
        prompts.append(dict(obj, **{"class": _class_id(obj["class"], num_classes, class_names, where), "n": n}))
    if not prompts:
        raise SampleError(f"--prompts {path}: no prompts in the file")
    return prompts


def prompt_items(prompts: List[dict]) -> List[Item]:
    """Global indices run over the prompts in file order, then over each prompt's samples."""
    items = []
    for p, obj in enumerate(prompts):
        for s in range(obj["n"]):
            items.append(Item(len(items), obj["class"], prompt_path(p, s), prompt=p))
    return items


def pieces(pending: Sequence[int], world_size: int, rank: int, size: int) -> List[Tuple[int, int]]:
    """This rank's share of the pending indices as (first index, count) runs of consecutive
    indices, at most `size` long (one decode call each: `first_index` keys a call's images to
    consecutive global indices). The runs are dealt round-robin, so a rank's share stays
    balanced when an earlier run left holes anywhere."""
    runs: List[Tuple[int, int]] = []
    for i in sorted(pending):
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][1] < size:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs[rank::world_size]


def describe_classes(classes: Optional[List[int]], prompts: Optional[List[dict]]) -> Dict[str, object]:
    """The conditioning part of the run's settings (compared when a directory is continued)."""
    if prompts is not None:
        return {"conditioning": "prompts", "prompts": prompts}
    return {"conditioning": "classes", "classes": classes if classes is not None else "index % num_classes"}
