"""What a request asks the engine for: the one place that turns a request's `prompt` (and
`class_id`) into what `StreamingEngine.submit` takes.

A class-conditional family reads the prompt as a class: its id ("7") or its name, in any case
("Sneaker", "sneaker"; each part of a name with a slash too: "T-shirt/top", "t-shirt", "top").
A prompt-conditioned family (a text-to-image target: Janus-Pro, Emu3, Lumina-mGPT; GLM-Image,
whose stream drafts with its preview stage) takes the prompt as it is: the engine encodes it as
`decode(prompts=[...])` does, and refuses it at `submit` when the model cannot take it."""
from __future__ import annotations

from typing import List, Optional

from specdec.serve.errors import invalid


def _field(family, name: str):
    return family.get(name) if isinstance(family, dict) else getattr(family, name, None)


def prompt_conditioned(family) -> bool:
    """Whether the family's images are conditioned on prompts rather than class ids."""
    return getattr(_field(family, "target"), "num_classes", None) is None


def class_names(family) -> List[str]:
    """Each class's name (its id as a string where the family names none)."""
    count = _field(family, "target").num_classes
    names = _field(family, "class_names") or ()
    return [names[i] if i < len(names) else str(i) for i in range(count)]


def _match_class(prompt: str, names: List[str]) -> Optional[int]:
    text = prompt.strip()
    if text.isascii() and text.isdigit():   # (str.isdigit takes "²" and "٣", which int() reads or not)
        return int(text) if int(text) < len(names) else None
    wanted = text.casefold()
    for i, name in enumerate(names):
        if wanted == name.casefold() or wanted in (part.strip().casefold() for part in name.split("/")):
            return i
    return None


def class_id_for(prompt: str, class_id: Optional[int], family) -> int:
    """The class a request names: `class_id` when given (the prompt is then free text), else the
    class the prompt names."""
    names = class_names(family)
    if class_id is not None:
        if not 0 <= class_id < len(names):
            raise invalid(f"class_id must lie in [0, {len(names)}), got {class_id}", "class_id")
        return class_id
    found = _match_class(prompt, names)
    if found is None:
        listed = ", ".join(f"{i} {name!r}" for i, name in enumerate(names))
        raise invalid(f"this model makes images of a class: the prompt must name one by its id or name "
                      f"({listed}), got {prompt[:80]!r}", "prompt", "unknown_class")
    return found


def conditions_for(prompt: str, class_id: Optional[int], n: int, family) -> List[dict]:
    """What `StreamingEngine.submit` takes for each of a request's `n` images: a class id
    (`condition`), or the prompt."""
    if prompt_conditioned(family):
        if class_id is not None:
            raise invalid("class_id is for class-conditional models; this model takes the prompt", "class_id")
        return [dict(prompt=prompt)] * n
    return [dict(condition=class_id_for(prompt, class_id, family))] * n


__all__ = ["class_id_for", "class_names", "conditions_for", "prompt_conditioned"]
