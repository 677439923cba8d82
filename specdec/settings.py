"""The settings of a decode, as frozen dataclasses: `Sampling` (how a distribution is formed from
logits; `SamplingArgs` is its part the kernels take) and `RunSettings` (what decides a run's
images and how it runs). A low module: models may import it (a model family ships its own
sampling defaults), and it imports nothing of specdec.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

#: The kernel backends (`specdec.ops`), by name; None picks by device.
BACKENDS = ("cuda", "triton", "cpu", "reference")
#: the bounds of `Sampling`'s cfg_scale and temperature (why: `Sampling.__post_init__`)
MAX_CFG_SCALE = 1e4
MIN_TEMPERATURE = 1e-4


class SamplingArgs(NamedTuple):
    """The sampling settings of the pooling kernels (steps 1-3 of kernel 1), already checked, in the
    order of the op schemas; `Sampling.args` builds them and the ops' fast path takes them as
    they are."""

    cfg_scale: float
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class Sampling:
    """How the target's distribution p is formed from its logits (and the draft's q alike)."""

    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0  #: nucleus after top-k (LlamaGen's and Janus's samplers); 1 = off
    #: LlamaGen's `cfg_interval`: when > -1, guidance stops after raster token cfg_interval + 1
    #: (token t is guided iff t - 1 <= cfg_interval; later tokens use the conditional logits).
    #: -1 = guidance for every token (the default).
    cfg_interval: float = -1
    #: "always": guidance whenever cfg_scale != 1 (the default); "llamagen": only when
    #: cfg_scale > 1, as LlamaGen's generate does (cfg_scale <= 1 then samples the conditional logits).
    cfg_rule: str = "always"

    def __post_init__(self):
        # The kernels form p in float32: a guidance scale or a temperature beyond these bounds
        # would overflow the scaled logits to inf, and every token drawn from the NaN rows
        # that follow would be the last one of the vocabulary, with no error anywhere.
        if not (_is_number(self.cfg_scale) and abs(self.cfg_scale) <= MAX_CFG_SCALE):
            raise ValueError(f"cfg_scale must be a finite number in [-{MAX_CFG_SCALE:g}, {MAX_CFG_SCALE:g}], got "
                             f"{self.cfg_scale!r}")
        if not (_is_number(self.temperature) and self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE:g} (top_k=1 samples "
                             f"greedily, ties at random), got {self.temperature!r}")
        check_int(self.top_k, "top_k")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a float in (0, 1], got {self.top_p!r}")
        if (isinstance(self.cfg_interval, bool) or not isinstance(self.cfg_interval, (int, float))
                or not math.isfinite(self.cfg_interval)):
            raise ValueError(f"cfg_interval must be a finite number (-1: guidance for every token), got "
                             f"{self.cfg_interval!r}")
        if self.cfg_interval < -1:      # (the same setting as -1: one value, so that equal settings compare equal)
            object.__setattr__(self, "cfg_interval", -1)
        if self.cfg_rule not in ("always", "llamagen"):
            raise ValueError(f"cfg_rule must be 'always' or 'llamagen', got {self.cfg_rule!r}")

    @property
    def guided(self) -> bool:
        if self.cfg_rule == "llamagen":
            return self.cfg_scale > 1.0
        return self.cfg_scale != 1.0

    @property
    def has_cfg_interval(self) -> bool:
        return self.guided and self.cfg_interval > -1

    @property
    def args(self) -> SamplingArgs:
        """The settings the kernels take (checked here once, so the decoders' fast path does not)."""
        return SamplingArgs(float(self.cfg_scale), float(self.temperature), self.top_k, float(self.top_p))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: the largest int the ops and the kernels take (an int64)
MAX_INT = 2 ** 63 - 1


def check_int(value, name: str, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """`value` if it is an int (not a bool) in [`minimum`, `maximum`], else a ValueError naming
    `name`: the check of every count among the settings and the methods' options (by default at
    most an int64, what the kernels take)."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value > maximum:
        top = "2**63 - 1" if maximum == MAX_INT else maximum
        raise ValueError(f"{name} must be an int in [{minimum}, {top}], got {value!r}")
    return value


class OptionError(ValueError):
    """A method's option that does not fit the models it runs on (a window wider than the grid,
    more vertical heads than the heads have): `option` names it, so that a server's 400 can."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


#: seeds are ints in [0, 2**32): torch's CPU generators, which draw every image's numbers, keep
#: 32 bits of their seed, so a larger seed would silently give a smaller one's images; image
#: indices likewise (`first_index` and the indices after it)
SEEDS = INDICES = 2 ** 32


def check_seed(seed, name: str = "seed") -> int:
    """A run's or a request's seed: an int in [0, 2**32), the range in which two seeds always
    give two different images (`specdec.decoding.streams.image_generator`)."""
    if not _is_int(seed) or not 0 <= seed < SEEDS:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {seed!r}")
    return seed


@dataclass(frozen=True)
class RunSettings:
    """What every decoder takes besides its models and its method's options: the settings that
    decide a run's images (seed, first image index, sampling) and how it runs (backend, batch
    size, compile, progress). Built once by whoever starts the run (the CLI, `specdec sample`,
    a benchmark) and passed whole.

    Image i of a run depends only on (seed, first_index + i), whatever the batch size."""

    seed: int = 0
    #: the index of the first image in a longer run decoded in several calls
    first_index: int = 0
    #: None: the family's own (`decoding.decode` fills it in; a method module takes Sampling())
    sampling: Optional[Sampling] = None
    #: a kernel backend (BACKENDS) or None (by device; SPECDEC_BACKEND overrides)
    backend: Optional[str] = None
    #: images decoded in the same passes (1: the latency setting speculative decoding is for)
    batch_size: int = 1
    #: continuous batching: images decoded at once, each in a row of its own that the next image
    #: takes as soon as it is done (None: lockstep batches of batch_size)
    concurrency: Optional[int] = None
    #: the most image tokens one target pass may feed, over all the images decoded at once (like
    #: vLLM's max_num_batched_tokens; None: no limit). Each image gets an equal share
    #: (`token_share`) and its method narrows its speculation to fit it, down to plain AR steps
    #: at a share of one token.
    max_tokens_per_pass: Optional[int] = None
    #: model passes through torch.compile (CUDA graphs on a GPU), padded to a few widths
    compile: bool = False
    #: exact mode: every token is drawn with noise keyed by (seed, image index, raster position),
    #: so `ar`'s image for a seed is also `sd`'s and `sjd`'s, bit for bit, whatever their draft
    #: lengths, windows, batch, concurrency or token budget (drafts are kept only where they equal
    #: the target's own token). Only the lossless methods can be exact
    #: (`specdec.decoding.EXACT_METHODS`).
    exact: bool = False
    #: `sd`'s draft length and `sjd`'s window chosen each step to commit the most tokens per
    #: second of the step's passes (`specdec.decoding.widths`): their options then give the
    #: widest; at load on a compute-bound device, plain AR steps. None: on in exact mode (where a
    #: width cannot change an image), off otherwise (the image would depend on the load)
    adaptive_width: Optional[bool] = None
    #: called with the number of images done after each batch
    progress: Optional[Callable[[int], None]] = None

    def __post_init__(self):
        check_seed(self.seed)
        check_int(self.first_index, "first_index", 0, INDICES - 1)
        if self.sampling is not None and not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a specdec Sampling, got {type(self.sampling).__name__}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {self.backend!r}")
        check_int(self.batch_size, "batch_size", 1)
        if self.concurrency is not None:
            check_int(self.concurrency, "concurrency", 1)
            if self.batch_size != 1:
                raise ValueError("pass batch_size (lockstep batches) or concurrency (continuous batching), not both")
        if self.max_tokens_per_pass is not None:
            check_int(self.max_tokens_per_pass, "max_tokens_per_pass", 1)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be True or False, got {self.exact!r}")
        if self.adaptive_width is not None and not isinstance(self.adaptive_width, bool):
            raise ValueError(f"adaptive_width must be True, False or None, got {self.adaptive_width!r}")
        if self.progress is not None and not callable(self.progress):
            raise ValueError(f"progress must be callable (images done -> None) or None, got {self.progress!r}")

    @property
    def adapts_width(self) -> bool:
        """Whether `sd` and `sjd` choose their width each step (`adaptive_width`; by default in
        exact mode)."""
        return self.exact if self.adaptive_width is None else self.adaptive_width

    @property
    def token_share(self) -> Optional[int]:
        """The most image tokens one image may feed a target pass (the prompt's prefill aside):
        the budget over the images decoded at once (`concurrency`, else `batch_size`), at least
        one; None without a budget. It depends on the settings alone, never on which images share
        a pass, so image i still depends only on (seed, first_index + i) and these settings."""
        if self.max_tokens_per_pass is None:
            return None
        return max(1, self.max_tokens_per_pass // (self.concurrency or self.batch_size))

    @property
    def sampling_or_default(self) -> Sampling:
        """The sampling, or plain sampling (no guidance, temperature 1) when none was set."""
        return self.sampling if self.sampling is not None else Sampling()


__all__ = ["BACKENDS", "MAX_CFG_SCALE", "MAX_INT", "MIN_TEMPERATURE", "RunSettings", "Sampling", "SamplingArgs",
           "INDICES", "OptionError", "SEEDS", "check_int", "check_seed"]
