"""What every decoder shares: sampling settings, statistics, results, and a thin view of a model
with its KV cache that counts forward passes and turns logits into the numbers the kernels need.

All randomness goes through caller-supplied uniforms drawn from one stream per image
(`ImageStreams`: image i of a run seeded s always draws from `image_generator(s, i)`), so a
decode is a pure function of (model, classes, settings, seed), identical on every kernel backend
(the ops are bit-exact against their reference given the uniforms), and image i's tokens do not
depend on the batch it was decoded in.
"""
from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import torch

from specdec import ops
from specdec.decoding import kernels
from specdec.models.conditions import is_prompts
from specdec.models.protocol import split_cfg


# ----------------------------------------------------------------------------------------------
# settings, results, statistics
# ----------------------------------------------------------------------------------------------

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
        if not (isinstance(self.cfg_scale, (int, float)) and math.isfinite(self.cfg_scale)):
            raise ValueError(f"cfg_scale must be a finite number, got {self.cfg_scale!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a float in (0, 1], got {self.top_p!r}")
        if (isinstance(self.cfg_interval, bool) or not isinstance(self.cfg_interval, (int, float))
                or not math.isfinite(self.cfg_interval)):
            raise ValueError(f"cfg_interval must be a finite number (-1: guidance for every token), got "
                             f"{self.cfg_interval!r}")
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


def unguided_after_interval(sampling: Sampling, cond: torch.Tensor, uncond: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    """LlamaGen's cfg_interval: the unconditional logits [B, N, V] with the conditional ones in
    place at the outputs fed at raster `positions` ([N] or [B, N]; the output predicts the token
    after, t = position + 1) that come after the interval, so that guidance gives exactly the
    conditional logits there (uncond + s * (cond - cond) = cond). A tensor op: no host read."""
    off = positions.to(cond.device) > sampling.cfg_interval
    if off.dim() == 2 and off.shape[0] != cond.shape[0]:   # [rows, N] positions of a CFG cache
        off = off[:cond.shape[0]]
    off = off.view(1, -1, 1) if off.dim() == 1 else off[..., None]
    return torch.where(off, cond, uncond)


@dataclass
class DecodeStats:
    """Cost and behaviour of one decode (summed over the images of the call)."""

    method: str
    images: int = 0
    tokens: int = 0                     #: tokens committed (images * H * W)
    target_forwards: int = 0            #: target passes, the prefill included
    draft_forwards: int = 0             #: drafter passes (drafter model, heads, or 0)
    wall_s: float = 0.0
    #: per verification iteration, bool [H, W] (or [1, n] for raster chunks): drafted positions kept
    acceptance_maps: List[torch.Tensor] = field(default_factory=list)
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def tokens_per_target_pass(self) -> float:
        return self.tokens / max(1, self.target_forwards)

    @property
    def target_forwards_per_image(self) -> float:
        return self.target_forwards / max(1, self.images)

    def merge(self, other: "DecodeStats") -> None:
        self.images += other.images
        self.tokens += other.tokens
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.wall_s += other.wall_s
        self.acceptance_maps.extend(other.acceptance_maps)
        # extra holds per-image lists (island maps, pass counts ...): concatenate them.
        for k, v in other.extra.items():
            self.extra.setdefault(k, []).extend(v if isinstance(v, list) else [v])

    def summary(self) -> str:
        return (f"{self.method}: {self.images} image(s), {self.target_forwards_per_image:.1f} target passes/image, "
                f"{self.tokens_per_target_pass:.2f} tokens/pass, {self.draft_forwards} draft passes, "
                f"{self.wall_s:.2f} s")


class DecodeResult(NamedTuple):
    tokens: torch.Tensor             #: int64 [B, H, W] token grids
    images: Optional[torch.Tensor]   #: [B, C, h, w] in [-1, 1] (None without a tokenizer)
    stats: DecodeStats


# ----------------------------------------------------------------------------------------------
# randomness and kernel dispatch
# ----------------------------------------------------------------------------------------------

def image_generator(seed: int, index: int = 0) -> torch.Generator:
    """The generator of image `index` of a run seeded `seed`: images are reproducible one by one."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    mixed = (seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 62)
    return torch.Generator().manual_seed(mixed)


class ImageStreams:
    """The random streams of the images of one batch, one CPU generator per image.

    A draw of shape [B * m, ...] gives image b the rows [b * m, (b + 1) * m) from its own
    generator, so every image consumes its stream exactly as it would decoded alone: with one
    image this is `torch.rand(shape, generator=image_generator(seed, index))`, the stream of
    the single-image decoders. CPU generators make the numbers the same on every device."""

    def __init__(self, seed: int, indices):
        self.indices = list(indices)
        self.generators = [image_generator(seed, i) for i in self.indices]
        self.paused = [False] * len(self.generators)

    def __len__(self) -> int:
        return len(self.generators)

    def _draw(self, b: int, shape) -> torch.Tensor:
        if self.paused[b]:
            return torch.zeros(shape, dtype=torch.float32)
        return torch.rand(shape, generator=self.generators[b], dtype=torch.float32)

    def rand(self, shape) -> torch.Tensor:
        shape = tuple(shape)
        n = len(self.generators)
        if n == 1:
            return self._draw(0, shape)
        if not shape or shape[0] % n:
            raise ValueError(f"a draw for {n} images needs a leading dimension divisible by {n}, got {shape}")
        per = (shape[0] // n,) + shape[1:]
        return torch.cat([self._draw(b, per) for b in range(n)])

    def only(self, active) -> "ImageStreams":
        """The same streams with the images where `active` [B] is False paused: their draws are
        zeros and leave their streams where they are. For a phase that some images of a batch have
        finished while others go on (SSD's row 0), so that a finished image continues its stream
        afterwards exactly where it would decoded alone."""
        view = object.__new__(ImageStreams)
        view.indices, view.generators = self.indices, self.generators
        view.paused = [p or not bool(a) for p, a in zip(self.paused, active)]
        return view

    def rand_where(self, mask: torch.Tensor) -> torch.Tensor:
        """One uniform per set entry of mask [B, L] (row-major), image b's from its own stream:
        the draw an image would make alone for its own set entries."""
        if len(self.generators) == 1:
            return self._draw(0, (int(mask.sum()),))
        return self.rand_counts(mask.reshape(mask.shape[0], -1).sum(1).tolist())

    def rand_counts(self, counts) -> torch.Tensor:
        """counts[b] uniforms from image b's stream, concatenated: `rand_where` for a caller that
        already has the per-image counts on the host (no read-back)."""
        if len(counts) != len(self.generators):
            raise ValueError(f"{len(counts)} counts for {len(self.generators)} images")
        return torch.cat([self._draw(b, (c,)) for b, c in enumerate(counts)])

    def rand_padded(self, counts, width: int, *, right: bool = False) -> torch.Tensor:
        """[B, width]: row b holds counts[b] uniforms from image b's stream, then zeros (padding
        that draws nothing; `right=True`: the zeros first): for a pass whose images judge windows
        of different lengths."""
        if len(counts) != len(self.generators):
            raise ValueError(f"{len(counts)} counts for {len(self.generators)} images")
        rows = [(self._draw(b, (c,)), torch.zeros(width - c)) for b, c in enumerate(counts)]
        return torch.stack([torch.cat(row[::-1] if right else row) for row in rows])

    def image(self, b: int) -> "ImageStreams":
        """The stream of image b alone (shared state: drawing from it advances image b here too)."""
        one = object.__new__(ImageStreams)
        one.indices, one.generators, one.paused = [self.indices[b]], [self.generators[b]], [self.paused[b]]
        return one


#: The switch of `to_device`'s asynchronous uploads: opt-in until they have run on a GPU.
ASYNC_UPLOADS_ENV = "SPECDEC_ASYNC_UPLOADS"


def async_uploads() -> bool:
    """Whether `to_device` copies to CUDA asynchronously: SPECDEC_ASYNC_UPLOADS=1 (unset or 0: the
    plain blocking copy, the path that has run on a GPU)."""
    value = os.environ.get(ASYNC_UPLOADS_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ASYNC_UPLOADS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def to_device(data, device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Host data (numbers in nested lists, or a CPU tensor) as a tensor on `device`, without
    waiting for the device when asked to (`async_uploads`).

    A plain copy from ordinary (pageable) host memory to a GPU is a blocking copy: PyTorch
    synchronizes the stream around it, so the host first waits for every kernel already queued
    (`torch.cuda.set_sync_debug_mode` reports it as a sync). The decoders send index lists and
    uniforms to the device every pass; with SPECDEC_ASYNC_UPLOADS=1 they go through pinned memory
    and an asynchronous copy on CUDA, ordered on the stream before the kernels that read them
    (opt-in: it has not run on a GPU yet). On the CPU this is the plain tensor."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or not async_uploads():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def uniforms(gen, shape, device) -> torch.Tensor:
    """float32 uniforms in [0, 1) from `gen` (ImageStreams or a CPU torch.Generator), moved to
    `device` (same numbers anywhere)."""
    if isinstance(gen, ImageStreams):
        return to_device(gen.rand(shape), device)
    return to_device(torch.rand(shape, generator=gen, dtype=torch.float32), device)


def step_uniforms(gen, steps: int, per_step: int, device) -> torch.Tensor:
    """[steps, per_step] float32: row s holds the uniforms that the s-th of `steps` successive
    `uniforms(gen, (per_step,), device)` calls would return, drawn at once (a loop of steps then
    draws nothing per step; each image's stream is consumed exactly as step by step)."""
    if isinstance(gen, ImageStreams):
        n = len(gen)
        if per_step % n:
            raise ValueError(f"a draw for {n} images needs a count divisible by {n}, got {per_step}")
        per = per_step // n     # each image draws `per` numbers a step, step after step
        u = gen.rand((n * steps * per,)).view(n, steps, per)
        return to_device(u.transpose(0, 1).reshape(steps, per_step), device)
    return to_device(torch.rand((steps, per_step), generator=gen, dtype=torch.float32), device)


def op_backend(name: str, backend: Optional[str], device: torch.device) -> Optional[str]:
    """`backend`, except that an extension built before op `name` existed falls back to the reference."""
    if backend is None and device.type == "cpu" and not hasattr(torch.ops.specdec, name):
        return "reference"
    return backend


def draw(probs: torch.Tensor, gen: torch.Generator, backend=None) -> torch.Tensor:
    """One token per row of probs [M, V] (inverse CDF with generator uniforms) -> int64 [M]."""
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    u = uniforms(gen, (probs.shape[0],), probs.device)
    out = kernels.sample_residual(probs, None, u, op_backend("sample_residual", backend, probs.device))
    return out.tokens.long()


def draw_residual(p: torch.Tensor, q: torch.Tensor, gen, backend=None, *,
                  with_distribution: bool = False, rows_of: Optional[torch.Tensor] = None, counts=None):
    """One token per row from norm(max(0, p - q)) (p where that is zero) -> int64 [M].

    with_distribution=True also returns that residual distribution [M, V]: SSD's later rounds use
    it as the q of the token (the others skip the [M, V] work). `rows_of` [B, L] bool: the rows of
    p are the set entries of this mask over a batch (p = p_all[mask]), so each image draws its
    own rows' uniforms from its own stream. `counts` (host ints, one per image): the same with
    the number of rows of each image given instead of the mask (no read-back)."""
    if counts is not None and isinstance(gen, ImageStreams):
        u = to_device(gen.rand_counts(list(counts)), p.device)
    elif rows_of is not None and isinstance(gen, ImageStreams):
        u = to_device(gen.rand_where(rows_of), p.device)
    else:
        u = uniforms(gen, (p.shape[0],), p.device)
    out = kernels.sample_residual(p, q, u, op_backend("sample_residual", backend, p.device))
    if not with_distribution:
        return out.tokens.long()
    resid = (p - q).clamp_min(0)
    resid = torch.where(out.fallback[:, None], p, resid)
    resid = resid / resid.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.tokens.long(), resid


def verify(p, q=None, *, gen: Optional[torch.Generator] = None, backend=None, **kw):
    """verify_grid (the checked fast path, `kernels.verify_grid`) with generator-drawn uniforms for
    rule="ratio"."""
    if kw.get("rule") == "ratio":
        kw["uniforms"] = uniforms(gen, tuple(p.shape), p.device)
    return kernels.verify_grid(p, q, backend=op_backend("verify_grid", backend, p.device), **kw)


# ----------------------------------------------------------------------------------------------
# a model with its cache
# ----------------------------------------------------------------------------------------------

class Outputs(NamedTuple):
    """Outputs of a forward at N positions: guidance halves and pre-norm hidden states."""

    cond: torch.Tensor               #: [B, N, V] conditional logits
    uncond: Optional[torch.Tensor]   #: [B, N, V] unconditional logits (None without CFG)
    hidden: torch.Tensor             #: [rows, N, dim] (rows = 2B with CFG)
    #: [B, N, V] the runner's sampling distribution of every output, when the pass computed it
    #: (a compiled pass does, inside its graph); None: `ModelRunner.probs` computes it
    probs: Optional[torch.Tensor] = None

    def select(self, index) -> "Outputs":
        """Outputs at the positions `index` (anything that indexes dim 1)."""
        return self.map(lambda t: t[:, index])

    def map(self, f) -> "Outputs":
        """`f` applied to every tensor of the outputs (each indexed alike along its first two dims)."""
        return Outputs(*(None if t is None else f(t) for t in self))

    @staticmethod
    def cat(parts) -> "Outputs":
        parts = list(parts)
        fields = zip(*parts)
        return Outputs(*(None if any(t is None for t in ts) else torch.cat(ts, 1) for ts in fields))


class ModelRunner:
    """A model, its slot KV cache and a pass counter; all decoders talk to models through it."""

    def __init__(self, model, sampling: Sampling, *, batch: int = 1, backend: Optional[str] = None):
        self.model = model
        self.sampling = sampling
        self.backend = backend
        self.batch = batch
        if sampling.guided and not supports_guidance(model):
            raise ValueError("cfg_scale != 1 needs a model with a null class (trained with label dropout)")
        self.cache = model.new_cache(batch, cfg=sampling.guided)
        self.forwards = 0
        #: a `specdec.decoding.compiled.CompiledForward` when the target passes are compiled
        #: (`compiled_runner`); None: eager passes
        self.compiled_forward = None
        self.token_step = None   #: the compiled AR step of a compiled runner, once made
        #: other compiled functions kept with a compiled runner (`compiled.runner_function`)
        self.functions = {}
        # The checked fast path (see specdec.decoding.kernels): models that offer it skip the
        # per-pass value checks of positions and token ids, which the decoders produce themselves.
        self._fast = {"checked": False} if "checked" in inspect.signature(model.forward_tokens).parameters else {}
        H, W = model.grid
        self.H, self.W = H, W
        self.device = self.cache.device

    def reset(self) -> None:
        """Empty the cache (every slot invalid) and the pass counter, for the next batch of the
        same shape: the cache tensors keep their addresses (what compiled steps rely on)."""
        self.cache.reset()
        self.forwards = 0

    def outputs(self, logits: torch.Tensor, hidden: torch.Tensor) -> Outputs:
        """Outputs from raw [rows, N, V] logits (e.g. the LM head on predicted hidden states)."""
        if self.sampling.guided:
            cond, uncond = split_cfg(logits)
            return Outputs(cond, uncond, hidden)
        return Outputs(logits, None, hidden)

    def _split(self, out) -> Outputs:
        return self.outputs(out.logits, out.hidden)

    def prefill(self, classes: torch.Tensor) -> Outputs:
        """Write the condition; returns the outputs giving the distribution of token 0 ([B, 1, V])."""
        self.forwards += 1
        classes = to_device(classes, self.device) if isinstance(classes, torch.Tensor) else classes.to(self.device)
        if (self.compiled_forward is not None and isinstance(classes, torch.Tensor)
                and getattr(self.model, "compilable_prefill", False)):
            from specdec.decoding.compiled import runner_function

            model, cache, backend = self.model, self.cache, self.backend

            def make():
                def prefill(c):
                    return tuple(model.prefill(cache, c, backend=backend))
                return prefill
            return self.outputs(*runner_function(self, ("prefill", tuple(classes.shape)), make)(classes))
        return self._split(self.model.prefill(self.cache, classes, backend=self.backend))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *, tree_mask=None, write=True) -> Outputs:
        """Feed tokens [B, N] at raster positions [N] or [B, N]; output i is the distribution of the
        token that follows position i in raster order."""
        self.forwards += 1
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        if self.compiled_forward is not None:
            logits, hidden, probs = self.compiled_forward(tokens, positions, tree_mask, write)
            return self.outputs_at(logits, hidden, positions)._replace(probs=probs)
        out = self.model.forward_tokens(self.cache, tokens, positions, tree_mask=tree_mask, write=write,
                                        backend=self.backend, **self._fast)
        return self.outputs_at(out.logits, out.hidden, positions)

    def outputs_at(self, logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Outputs:
        """Outputs of a pass's raw logits [rows, N, V] fed at raster `positions` ([N] or [B, N]):
        `outputs`, with LlamaGen's cfg_interval applied at each output's position. A compiled pass
        calls it inside its graph too, to make `probs` of the same outputs."""
        o = self.outputs(logits, hidden)
        if self.sampling.has_cfg_interval:
            o = o._replace(uncond=unguided_after_interval(self.sampling, o.cond, o.uncond, positions))
        return o

    def invalidate(self, positions: torch.Tensor) -> None:
        """Forget the cache entries of raster positions [N] or [B, N]."""
        if positions.numel():
            self.cache.invalidate_positions(positions)

    def invalidate_where(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """Forget the entries of positions [B, N] where mask [B, N] is set (a different count per
        row; no host read)."""
        if positions.numel():
            self.cache.invalidate_positions(positions, where=mask)

    # ---- distributions through the kernels ----
    def _kw(self, o: Outputs):
        s = self.sampling
        return dict(cfg_scale=s.cfg_scale, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def probs(self, o: Outputs) -> torch.Tensor:
        """The sampling distribution [B, N, V] (CFG, temperature, top-k) of every output (the
        one its pass computed, when it did)."""
        if o.probs is not None:
            return o.probs
        B, N, V = o.cond.shape
        p = ops.sampling_probs(o.cond.reshape(-1, V),
                               uncond_logits=None if o.uncond is None else o.uncond.reshape(-1, V),
                               backend=op_backend("sampling_probs", self.backend, o.cond.device), **self._kw(o))
        return p.view(B, N, V)

    def token_probs(self, o: Outputs, tokens: torch.Tensor, neighbors=None, delta=None):
        """PooledProbs over [B, N]: p(x) of each token x and its neighbour-pooled version."""
        B, N, V = o.cond.shape
        out = kernels.pool_probs(o.cond.reshape(-1, V), tokens.reshape(-1).to(o.cond.device), neighbors,
                             uncond_logits=None if o.uncond is None else o.uncond.reshape(-1, V), delta=delta,
                             backend=op_backend("pool_probs", self.backend, o.cond.device), **self._kw(o))
        return type(out)(*(t.view(B, N) for t in out))


def supports_guidance(model) -> bool:
    """Whether `model` has an unconditional input for CFG: a null class, or (text-conditional
    models, `supports_cfg`) an unconditional prompt."""
    flag = getattr(model, "supports_cfg", None)
    return bool(flag) if flag is not None else getattr(model, "null_class", None) is not None


def check_grid_model(model, name: str = "model") -> None:
    for attr in ("grid", "vocab_size", "prefix_len", "new_cache", "prefill", "forward_tokens"):
        if not hasattr(model, attr):
            raise ValueError(f"{name} does not implement the ARImageModel protocol (no `{attr}`)")


def check_classes(model, classes):
    """Class ids as an int64 tensor [B], range-checked; a `Prompts` batch passes as it is."""
    if is_prompts(classes):
        return classes
    if not isinstance(classes, torch.Tensor):
        classes = torch.as_tensor(classes)
    if classes.dim() != 1 or classes.dtype not in (torch.int32, torch.int64) or classes.numel() == 0:
        raise ValueError(f"classes must be a non-empty 1-D int tensor, got {tuple(classes.shape)} {classes.dtype}")
    n = getattr(model, "num_classes", None)
    if n is not None and (int(classes.min()) < 0 or int(classes.max()) >= n):
        raise ValueError(f"classes must lie in [0, {n}), got [{int(classes.min())}, {int(classes.max())}]")
    return classes.long()


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def one_image_at_a_time(decode_one):
    """A batch decoder from a single-image one, `decode_one(classes[1], streams, stats) -> tokens
    [1, H*W]` (which sets stats.target_forwards / draft_forwards for its image): the images of a
    batch are decoded in turn, each from its own stream, and their passes summed. For the methods
    whose images steer each other's passes when batched (see their modules)."""
    def run(classes, streams, stats):
        grids, target, draft = [], 0, 0
        for b in range(classes.shape[0]):
            stats.target_forwards = stats.draft_forwards = 0
            grids.append(decode_one(classes[b:b + 1], streams.image(b), stats))
            target, draft = target + stats.target_forwards, draft + stats.draft_forwards
        stats.target_forwards, stats.draft_forwards = target, draft
        return torch.cat(grids)
    return run


def concat_results(method: str, parts: List[DecodeResult]) -> DecodeResult:
    """One result from the results of consecutive calls (e.g. chunks of a run decoded with
    `first_index` set to each chunk's offset): grids and images concatenated, statistics summed."""
    stats = DecodeStats(method)
    for part in parts:
        stats.merge(part.stats)
    images = None
    if all(part.images is not None for part in parts):
        images = torch.cat([part.images for part in parts])
    return DecodeResult(torch.cat([part.tokens for part in parts]), images, stats)


def run_batches(method: str, model, classes, seed: int, decode_batch, *, batch_size: int = 1, tokenizer=None,
                progress=None, first_index: int = 0) -> DecodeResult:
    """Decode `classes` in batches: `decode_batch(classes[i:i+b], streams, stats) -> tokens [b, H*W]`
    with `streams = ImageStreams(seed, first_index + i .. first_index + i + b - 1)`, one random stream
    per image. Image i depends only on (seed, first_index + i), whatever the batch size: a run of
    N images split into calls with `first_index` set to each call's offset gives the same images as
    one call. batch_size=1 (the default everywhere) is the latency setting speculative decoding is
    for. Each batch is timed; the statistics are summed; the grids are decoded to images with
    `tokenizer` (not timed)."""
    check_grid_model(model, "target")
    classes = check_classes(model, classes)
    batch_size = check_batch_size(batch_size)
    if isinstance(first_index, bool) or not isinstance(first_index, int) or first_index < 0:
        raise ValueError(f"first_index must be an int >= 0, got {first_index!r}")
    H, W = model.grid
    total = DecodeStats(method)
    grids = []
    for i in range(0, classes.shape[0], batch_size):
        cls = classes[i:i + batch_size]
        stats = DecodeStats(method, images=cls.shape[0], tokens=cls.shape[0] * H * W)
        # Decoding is inference: without no_grad a model whose parameters require grad (a
        # transformers checkpoint, say) would record autograd graphs in eager passes, and
        # torch.compile would trace a training graph (a backward beside every compiled pass).
        with Timer() as t, torch.no_grad():
            streams = ImageStreams(seed, range(first_index + i, first_index + i + cls.shape[0]))
            grids.append(decode_batch(cls, streams, stats).view(-1, H, W).cpu())
        stats.wall_s = t.seconds
        total.merge(stats)
        if progress is not None:
            progress(min(i + batch_size, classes.shape[0]))
    tokens = torch.cat(grids)
    images = None
    if tokenizer is not None:
        with torch.no_grad():
            images = tokenizer.decode(tokens.to(next(tokenizer.parameters()).device)).cpu()
    return DecodeResult(tokens, images, total)
