"""Decoders on the ARImageModel protocol and the specdec kernels (docs/design.md, "Models and decoders").

    import specdec.decoding as dec
    from specdec.models import default
    fam = default()
    out = dec.decode("mulo", fam, classes=[0, 1, 2], seed=0, tau=0.05)
    out.tokens, out.images, out.stats          # grids, decoded images, DecodeStats

Each method is a module (`ar`, `sd`, `lantern`, `sjd`, `zipar`, `mulo`, `ssd`): a policy over the
rows of one persistent batch (`policy.RowPolicy`) and a `decode(target, conditions, *, <its
models>, options=<its options>, run=RunSettings(...))` that takes its models explicitly;
`decode(method, family, ...)` (specdec.decoding.api) takes them from a model family through the
module's hooks. `decode` (with `batch_size=...` or `concurrency=...`) and `stream(...)` all run
on `scheduler`'s one loop (admit -> step -> retire), `streaming` its engine for a server. The
other modules, by job: docs/contributing.md, "The package map".
"""
from __future__ import annotations

from specdec.decoding.api import (DEFAULT_SAMPLING, METHODS, OPTIONS, PRESETS, RESOURCES, check_method, decode,
                                  family_options, method_options, options_as_kwargs, options_for, stream)
from specdec.decoding.batching import EXACT_METHODS
from specdec.decoding.scheduler import Finished
from specdec.decoding.streaming import StreamingEngine
from specdec.decoding.ar import AROptions
from specdec.decoding.lantern import LanternOptions
from specdec.decoding.mulo import MuloOptions
from specdec.decoding.results import DecodeResult, DecodeStats, concat_results
from specdec.decoding.sd import SDOptions
from specdec.decoding.sjd import SJDOptions
from specdec.decoding.ssd import SSDOptions
from specdec.decoding.zipar import ZipAROptions
from specdec.settings import RunSettings, Sampling

__all__ = ["AROptions", "DEFAULT_SAMPLING", "DecodeResult", "DecodeStats", "EXACT_METHODS", "Finished",
           "LanternOptions", "METHODS", "MuloOptions", "OPTIONS", "PRESETS", "RESOURCES", "RunSettings",
           "SDOptions", "SJDOptions", "SSDOptions", "Sampling", "StreamingEngine", "ZipAROptions", "check_method",
           "concat_results", "decode", "family_options", "method_options", "options_as_kwargs", "options_for",
           "stream"]
