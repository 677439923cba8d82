"""argparse `type=` callables shared by the benchmark scripts (import as `from script_args import ...`
after putting benchmarks/ on the path, as for bench_helpers).

Every value a script takes is checked while its command line is parsed, before a model is built or
anything is timed: a bad one is refused with argparse's own error naming the flag (exit 2), so that
no run is wasted on it and no record is written under a label that did not run (an unknown mode
word used to run eager and be saved as that word).

    p.add_argument("--num-images", type=count(minimum=1), default="32")
    p.add_argument("--methods", type=names(decoding.METHODS, "method"), default=",".join(decoding.METHODS))

A string default goes through its type too (argparse converts it), so the defaults are checked and
given the same shape as a typed value.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Iterable, List, Optional


#: The modes a decoder benchmark times in: eager passes, or compiled graphs.
MODES = ("eager", "compiled")


def _refuse(message: str):
    """argparse prints an ArgumentTypeError's message after "argument --flag:" (a ValueError would
    become "invalid <type name> value", which says nothing about what is wanted)."""
    raise argparse.ArgumentTypeError(message)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        _refuse(f"{text!r} is not an int")


def _bounds(minimum: Optional[int], maximum: Optional[int]) -> str:
    if maximum is None:
        return f">= {minimum}"
    return f"in [{minimum}, {maximum}]"


def count(minimum: int = 1, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An int of at least `minimum` (and at most `maximum` when given)."""
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum or (maximum is not None and value > maximum):
            _refuse(f"must be an int {_bounds(minimum, maximum)}, got {text}")
        return value
    return parse


def _entries(text: str, what: str) -> List[str]:
    """The comma-separated entries of `text`, blanks dropped (a trailing comma is harmless), at
    least one."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        _refuse(f"give at least one {what} (comma-separated)")
    return entries


def _once_each(values: list, what: str) -> list:
    """`values` when none is there twice: a value named twice would be measured twice and its
    rows counted twice under one label."""
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        _refuse(f"{what} {', '.join(twice)} given twice")
    return values


def names(choices: Iterable[str], what: str = "name") -> Callable[[str], List[str]]:
    """A comma-separated list of words from `choices`, at least one, none twice."""
    allowed = tuple(choices)

    def parse(text: str) -> List[str]:
        entries = _entries(text, what)
        unknown = [e for e in entries if e not in allowed]
        if unknown:
            _refuse(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return _once_each(entries, what)
    return parse


def items(one: Callable[[str], object], what: str = "value", distinct: bool = True) -> Callable[[str], list]:
    """A comma-separated list, each entry read by `one` (a type of this module, or a script's own),
    at least one, none twice unless not `distinct` (counts per family, which may repeat)."""
    def parse(text: str) -> list:
        values = [one(e) for e in _entries(text, what)]
        return _once_each(values, what) if distinct else values
    return parse


def ints(minimum: int = 1, choices: Optional[Iterable[int]] = None, what: str = "value",
         distinct: bool = True) -> Callable[[str], List[int]]:
    """A comma-separated list of ints, each at least `minimum` or, given `choices`, one of them (the
    grids a script has families for), at least one, none twice unless not `distinct`."""
    if choices is None:
        return items(count(minimum), what, distinct)
    allowed = tuple(choices)

    def one(text: str) -> int:
        if _int(text) not in allowed:
            _refuse(f"unsupported {what} {text}; choose from {', '.join(map(str, allowed))}")
        return int(text)
    return items(one, what, distinct)


def positive_float(text: str) -> float:
    """A finite float above 0 (a rate, a time limit: 0 or less would measure nothing)."""
    try:
        value = float(text)
    except ValueError:
        _refuse(f"{text!r} is not a number")
    if not (value > 0 and math.isfinite(value)):
        _refuse(f"must be a number > 0, got {text}")
    return value


def device_name(text: str) -> str:
    """--device as specdec.cli_flags.check_device reads it (a torch device that exists here: cuda is
    refused on a machine without CUDA); the text itself, which the scripts record."""
    from specdec.cli_flags import check_device    # (here: a script that takes no --device needs no torch)

    try:
        check_device(text)
    except ValueError as e:
        # (its message starts with the flag, which argparse already names)
        message = str(e)
        _refuse(message[len("--device "):] if message.startswith("--device ") else message)
    return text


def thread_count(text: str) -> int:
    """torch CPU threads: an int in [1, the machine's CPUs] (torch refuses 0 with a traceback; more
    threads than CPUs only oversubscribe them)."""
    return count(1, os.cpu_count() or 1)(text)


def output_file(text: str) -> str:
    """A file the script writes (its JSON): not a folder, in a folder that exists and is writable,
    checked before anything is measured (a bad path used to be found after the measuring)."""
    from specdec.user_inputs import writable_file

    folder = os.path.dirname(os.path.abspath(text)) if text else ""
    if text and not os.path.isdir(folder):
        _refuse(f"{text}: its folder {folder} does not exist")
    if os.path.exists(text) and not os.path.isdir(text) and not os.access(text, os.W_OK):
        _refuse(f"{text} is not writable")
    try:
        writable_file(text, "the file")
    except ValueError as e:
        _refuse(str(e))
    return text


def output_folder(text: str) -> str:
    """A folder the script writes into, made now if it does not exist (specdec.user_inputs.writable_folder)."""
    from specdec.user_inputs import writable_folder

    try:
        writable_folder(text, "the folder")
    except ValueError as e:
        _refuse(str(e))
    return text


__all__ = ["MODES", "count", "device_name", "ints", "items", "names", "output_file", "output_folder", "positive_float",
           "thread_count"]
