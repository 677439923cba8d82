"""Save and load module weights as safetensors with their config in the file's metadata."""
from __future__ import annotations

import json
import os

import torch

from specdec.files import atomic_write


def save_weights(module: torch.nn.Module, path: str, config: dict, **info) -> None:
    from safetensors.torch import save

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    meta = {"config": json.dumps(config)}
    meta.update({k: json.dumps(v) for k, v in info.items()})
    # Renamed into place whole (`specdec.files`): a script stopped while saving (`train all`
    # stopping its scripts) leaves the old file, never a truncated one; and written by us, not by
    # safetensors' save_file, the file gets the umask's mode (save_file's are 0600).
    atomic_write(path, save(state, metadata=meta))


def load_module(path: str, build, hint: str = "train it first"):
    """(module in eval mode, other metadata) of a file written by save_weights.

    `build(config)` constructs the module from the config stored in the file; `hint` says how
    to produce a missing file.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: {hint}")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a weights file")
    from safetensors import SafetensorError

    try:
        state, config, info = load_weights(path)
    except (SafetensorError, ValueError) as e:     # (not safetensors, or metadata that is not JSON)
        raise ValueError(f"{path}: not a weights file of specdec's training scripts ({e})") from None
    try:
        module = build(config)
        module.load_state_dict(state)
    except (TypeError, KeyError, RuntimeError) as e:   # (another module's config or weights)
        raise ValueError(f"{path} holds other weights than expected ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]}): {hint}") from None
    return module.eval(), info


def load_weights(path: str):
    """(state_dict, config dict, other metadata dict) of a file written by save_weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    state = load_file(path)
    config = json.loads(meta.pop("config", "{}"))
    return state, config, {k: json.loads(v) for k, v in meta.items()}
