"""Loading the compiled extension specdec._C, checked against the torch it was built for.

A C++ extension works only with the torch it was compiled against: under another one it fails at
import with an `undefined symbol` deep in the dynamic loader, or worse, loads and misbehaves.
setup.py writes a build record (_C_build.json) next to the extension; `load` compares it with the
running torch before importing, and a mismatch is one ImportError naming both versions and the
command that rebuilds. An extension that is not there is not an error: the reference and Triton
backends still run, and a warning says so.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import warnings
from typing import Optional, Tuple

import torch

NAME = "specdec._C"
#: Written by setup.py beside the extension it builds.
RECORD = "_C_build.json"


class ExtensionMismatchError(ImportError):
    """specdec._C was built against another torch than the one running."""


def read_record(folder: str) -> Optional[dict]:
    """The build record in `folder` (None when absent or unreadable: a build older than records)."""
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def rebuild_command(record: Optional[dict]) -> str:
    """How to rebuild the extension for the running torch, by how it was built."""
    source = (record or {}).get("source")
    if source and not os.path.exists(os.path.join(source, "setup.py")):
        source = None
    if (record or {}).get("inplace"):
        where = f" in {source}" if source else ""
        return f"`make build` (or `python setup.py build_ext --inplace`){where}"
    return f"`pip install --no-build-isolation --force-reinstall --no-deps {source or '<specdec source folder>'}`"


def mismatch_message(built: str, running: str, record: Optional[dict]) -> str:
    return (f"specdec._C was built against torch {built} but torch {running} is installed; "
            f"rebuild it for this torch: {rebuild_command(record)}")


def load(name: str = NAME, torch_version: Optional[str] = None) -> Tuple[Optional[object], Optional[str]]:
    """(module, None) when the extension loads; (None, why) when it is absent or fails to load
    for a reason other than the torch version (a warning says the compiled backends are off).
    Raises ExtensionMismatchError when it was built for another torch."""
    running = torch_version or torch.__version__
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        why = (f"{name} is not built, so the cpu and cuda backends are unavailable (the reference and "
               "Triton backends run); build it with `pip install --no-build-isolation .` or `make build`")
        warnings.warn(why, RuntimeWarning, stacklevel=2)
        return None, why
    record = read_record(os.path.dirname(spec.origin))
    built = (record or {}).get("torch")
    if built is not None and built != running:
        raise ExtensionMismatchError(mismatch_message(built, running, record))
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if "undefined symbol" in str(exc):
            # No record (built before records existed) but the loader says the same thing.
            raise ExtensionMismatchError(mismatch_message(built or "another version", running, record)) from None
        why = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a broken build: keep going on the other backends
        why = f"{type(exc).__name__}: {exc}"
    else:
        return module, None
    warnings.warn(f"{name} failed to load, so the cpu and cuda backends are unavailable: {why}",
                  RuntimeWarning, stacklevel=2)
    return None, why


def build_record() -> Optional[dict]:
    """The loaded (or loadable) extension's build record, None when there is none."""
    try:
        spec = importlib.util.find_spec(NAME)
    except ImportError:
        return None
    return read_record(os.path.dirname(spec.origin)) if spec and spec.origin else None
