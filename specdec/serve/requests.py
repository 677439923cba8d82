"""A request's body checked and resolved into a `Plan`: which engine decodes it (method,
preset, options and sampling: an `EngineKey`), what each image is conditioned on, its seed and
image indices, and how the images are returned. Every check names the field it concerns, and
runs before anything reaches the engine loop."""
from __future__ import annotations

import dataclasses
import json
import random
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from specdec.decoding import DEFAULT_SAMPLING, METHODS, OPTIONS, options_for
from specdec.decoding.batching import not_exact
from specdec.serve.conditions import conditions_for
from specdec.serve.config import ServeConfig
from specdec.serve.errors import APIError, invalid
from specdec.serve.protocol import SAMPLING_FIELDS, ImageGenerationBody
from specdec.settings import INDICES, SEEDS, Sampling

#: seeds are ints in [0, 2**32) (`specdec.settings.SEEDS`: two seeds, two images)
MAX_SEED = SEEDS - 1
#: options a request cannot set over HTTP: they take Python objects
_NOT_OVER_HTTP = ("draft_sampling",)


@dataclass(frozen=True)
class EngineKey:
    """What an engine is built with beside the server's run settings; requests with equal keys
    share an engine (and its rows)."""

    method: str
    preset: Optional[str]
    options_json: str          #: the method's options, as sorted JSON (hashable)
    sampling: Sampling
    exact: bool                #: exact mode (`RunSettings.exact`): the image is `ar`'s for its seed

    @property
    def options(self) -> Dict[str, object]:
        return json.loads(self.options_json)


@dataclass(frozen=True)
class Plan:
    """A checked request: image j decodes conditions[j] as image first_index + j of `seed`."""

    key: EngineKey
    conditions: tuple
    seed: int
    first_index: int
    stream: bool
    partial_images: int
    output_format: str
    output_compression: Optional[int]
    return_tokens: bool
    size: str

    @property
    def n(self) -> int:
        return len(self.conditions)


class Planner:
    """Checks requests against one family and server configuration."""

    def __init__(self, family, config: ServeConfig, size: str, formats: tuple):
        """`size`: the "WxH" pixel size the family makes; `formats`: the output formats Pillow writes here."""
        self.family, self.config, self.size, self.formats = family, config, size, formats
        self._seeds = random.Random(config.run.seed)
        self._lock = threading.Lock()
        base = config.run.sampling or getattr(family, "sampling", None) or DEFAULT_SAMPLING
        self.default_sampling: Sampling = base

    def plan(self, body: ImageGenerationBody) -> Plan:
        c = self.config
        if body.model is not None and body.model != c.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist here; this server serves {c.model_name!r}",
                           "model", "model_not_found")
        method = c.method if body.method is None else body.method
        if method not in METHODS:
            raise invalid(f"unknown method {method!r}; choose one of {', '.join(METHODS)}", "method")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= c.max_n:
            raise invalid(f"n must lie in [1, {c.max_n}], got {n}", "n")
        self._check_output(body)
        key = EngineKey(method, *self._options(method, body), self._sampling(body), self._exact(method, body))
        seed = self._seed(body.seed)
        first = 0 if body.first_index is None else body.first_index
        if not 0 <= first <= INDICES - n:
            raise invalid(f"first_index + n must be at most 2**32 (image indices are below 2**32), got {first} + {n}",
                          "first_index")
        partial = 0 if body.partial_images is None else body.partial_images
        if not 0 <= partial <= 3:
            raise invalid(f"partial_images must lie in [0, 3], got {partial}", "partial_images")
        conditions = conditions_for(body.prompt, body.class_id, n, self.family)
        return Plan(key, tuple(conditions), seed, first, bool(body.stream), partial if body.stream else 0,
                    body.output_format or "png", body.output_compression, bool(body.return_tokens), self.size)

    def _check_output(self, body: ImageGenerationBody) -> None:
        if body.size not in (None, "auto", self.size):
            raise invalid(f"this model makes {self.size} images: size must be 'auto' or {self.size!r}, got "
                          f"{body.size!r}", "size", "unsupported_size")
        if body.response_format not in (None, "b64_json"):
            message = ("images are returned inline: response_format must be 'b64_json'" if body.response_format == "url"
                       else f"response_format must be 'b64_json', got {body.response_format!r}")
            raise invalid(message, "response_format")
        if body.output_format not in (None, *self.formats):
            raise invalid(f"output_format must be one of {', '.join(self.formats)}, got {body.output_format!r}",
                          "output_format")
        if body.output_compression is not None and not 0 <= body.output_compression <= 100:
            raise invalid(f"output_compression must lie in [0, 100], got {body.output_compression}",
                          "output_compression")
        if body.background not in (None, "auto", "opaque"):
            raise invalid(f"background must be 'auto' or 'opaque', got {body.background!r}", "background")

    def _options(self, method: str, body: ImageGenerationBody):
        """(preset, the options as sorted JSON): the server's own for its method, then the request's."""
        own = method == self.config.method
        preset = body.preset if body.preset is not None else (self.config.preset if own else None)
        given = body.options
        fields = [f.name for f in dataclasses.fields(OPTIONS[method]) if f.name not in _NOT_OVER_HTTP]
        for name in given:
            if name not in fields:
                raise invalid(f"{name!r} is not a field of this API nor an option of {method} (its options: "
                              f"{', '.join(fields) or 'none'})", name, "unknown_parameter")
        options = {**(self.config.options if own else {}), **given}
        try:
            options_for(method, preset, self.family, **options)
        except ValueError as e:
            raise invalid(str(e), self._culprit(method, preset, options)) from None
        try:
            return preset, json.dumps(options, sort_keys=True)
        except (TypeError, ValueError):
            raise invalid("the method's options must be JSON values", None) from None

    def _culprit(self, method: str, preset: Optional[str], options: dict) -> Optional[str]:
        """The option a ValueError of `options_for` is about (None: the preset)."""
        try:
            options_for(method, preset, self.family)
        except ValueError:
            return "preset"
        for name, value in options.items():
            try:
                options_for(method, preset, self.family, **{name: value})
            except ValueError:
                return name
        return None

    def _exact(self, method: str, body: ImageGenerationBody) -> bool:
        """The request's `exact` (default: the server's, `specdec serve --exact`); only a lossless
        method can be exact, and the error names what the client chose (`exact`, else `method`)."""
        exact = self.config.run.exact if body.exact is None else body.exact
        if exact and (why := not_exact(method)):
            if body.exact is not None:
                raise invalid(why, "exact")
            raise invalid(f"{why} (this server decodes in exact mode by default; send exact: false)",
                          "method")
        return exact

    def _sampling(self, body: ImageGenerationBody) -> Sampling:
        given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
        for name, value in given.items():   # (one at a time: the error names its field)
            try:
                dataclasses.replace(self.default_sampling, **{name: value})
            except ValueError as e:
                raise invalid(str(e), name) from None
        try:
            return dataclasses.replace(self.default_sampling, **given)
        except ValueError as e:
            raise invalid(str(e), next(iter(given), None)) from None

    def _seed(self, seed: Optional[int]) -> int:
        if seed is None:
            with self._lock:     # (handlers may plan from several threads)
                return self._seeds.randrange(2 ** 31)
        if not 0 <= seed <= MAX_SEED:
            raise invalid(f"seed must lie in [0, 2**32), got {seed}", "seed")
        return seed


def tokens_per_image(family) -> int:
    H, W = family.target.grid if not isinstance(family, dict) else family["target"].grid
    return H * W


__all__ = ["EngineKey", "MAX_SEED", "Plan", "Planner", "tokens_per_image"]
