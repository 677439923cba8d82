"""A model with its KV cache, as every decoder sees it: `ModelRunner` counts target passes,
splits guidance halves and turns logits into the numbers the kernels need; `TokenStep` is the AR
step (one token in, the next token out). The compiled runner is a subclass
(`specdec.decoding.compiled.CompiledRunner`); nothing here imports it.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, List, NamedTuple, Optional

import torch

from specdec.decoding.draws import race
from specdec.decoding.uploads import to_device
from specdec.models.protocol import image_rows, split_cfg
from specdec.ops import pooling, verification
from specdec.settings import Sampling

def unguided_after_interval(sampling: Sampling, cond: torch.Tensor, uncond: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    """LlamaGen's cfg_interval: the unconditional logits [B, N, V] with the conditional ones in
    place at the outputs fed at raster `positions` ([N] or [B, N]; the output predicts the token
    after, t = position + 1) that come after the interval, so that guidance gives exactly the
    conditional logits there (uncond + s * (cond - cond) = cond). A tensor op: no host read."""
    off = positions.to(cond.device) > sampling.cfg_interval
    if off.dim() == 2 and off.shape[0] != cond.shape[0]:   # [rows, N] positions of a CFG cache
        off = split_cfg(off)[0]
    off = off.view(1, -1, 1) if off.dim() == 1 else off[..., None]
    return torch.where(off, cond, uncond)


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

    def images(self, index: torch.Tensor) -> "Outputs":
        """The outputs of images `index` (int64 [k], on the device; with CFG each image's two
        hidden rows)."""
        def pick(t):
            return None if t is None else t.index_select(0, index)
        hidden_rows = image_rows(index, self.hidden.shape[0] // self.cond.shape[0])
        return Outputs(pick(self.cond), pick(self.uncond), self.hidden.index_select(0, hidden_rows), pick(self.probs))

    def first(self, k: int) -> "Outputs":
        """The outputs of the first k images (with CFG, the first 2k hidden rows)."""
        rows = k * self.hidden.shape[0] // self.cond.shape[0]
        return Outputs(self.cond[:k], None if self.uncond is None else self.uncond[:k], self.hidden[:rows],
                       None if self.probs is None else self.probs[:k])

    def map(self, f) -> "Outputs":
        """`f` applied to every tensor of the outputs (each indexed alike along its first two dims)."""
        return Outputs(*(None if t is None else f(t) for t in self))

    @staticmethod
    def cat(parts) -> "Outputs":
        fields = zip(*parts)
        return Outputs(*(None if any(t is None for t in ts) else torch.cat(ts, 1) for ts in fields))


def check_guidance(model, guided: bool) -> None:
    """A ValueError when sampling is `guided` (cfg_scale != 1) and `model` has no unconditional
    input for CFG: a null class, or (text-conditional models, `supports_cfg`) an unconditional
    prompt."""
    if not guided:
        return
    flag = getattr(model, "supports_cfg", None)
    if not (bool(flag) if flag is not None else getattr(model, "null_class", None) is not None):
        raise ValueError(f"cfg_scale != 1 needs classifier-free guidance, which {type(model).__name__} does not "
                         "have (a null class trained with label dropout, or an unconditional prompt): use cfg_scale=1")


def weights_key(module):
    """(dtype, device) of a module's first parameter, or None: a graph traced without guards is
    only valid for the weights' dtype and device it was traced with."""
    p = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
    return None if p is None else (p.dtype, p.device)


def count_pass(runner, width: int) -> None:
    """Count a pass of `width` image tokens per row in a runner's counters (any kind)."""
    runner.forwards += 1
    runner.fed += width
    runner.widest = max(runner.widest, width)


class ModelRunner:
    """A model, its slot KV cache and a pass counter; all decoders talk to models through it.
    Eager: every pass runs op by op (`specdec.decoding.compiled.CompiledRunner` compiles them)."""

    def __init__(self, model, sampling: Sampling, *, batch: int = 1, backend: Optional[str] = None, cache=None):
        """`cache`: the cache to run on (default: a new one of `batch` images; a view of another
        runner's first images for `prefix`)."""
        self.model = model
        self.sampling = sampling
        self.backend = backend
        self.batch = batch
        check_guidance(model, sampling.guided)
        self.cache = model.new_cache(batch, cfg=sampling.guided) if cache is None else cache
        self.forwards = 0
        self.fed = 0    #: image tokens fed per row by the passes so far (a pass of N tokens adds N)
        self.widest = 0  #: the most image tokens per row one pass fed (the prefill aside)
        #: the images a pass of all B rows goes over, the first `covered` (`cover`)
        self.covered = batch
        self._prefixes: dict = {}   # `prefix`: runners of the first k images, views of this cache
        self._sources: dict = {}    # `_spread`: the image whose outputs each of the B rows takes, by k
        self._spare: Optional["ModelRunner"] = None   # `part`: the parts' one cache of their own
        self._token_steps: dict = {}   # `token_step`, by exactness
        # Optional keywords of forward_tokens (the protocol's extras): `checked=False` skips the
        # per-pass value checks of positions and token ids, which the decoders produce themselves;
        # `reach` lets an AR step read only the cache prefix up to its position.
        params = inspect.signature(model.forward_tokens).parameters
        self._fast = {"checked": False} if "checked" in params else {}
        self._takes_reach = "reach" in params
        self.H, self.W = model.grid
        self.device = self.cache.device

    def reset(self) -> None:
        """Empty the cache (every slot invalid) and the pass counter, for the next batch of the
        same shape: the cache tensors keep their addresses (what compiled steps rely on)."""
        self.cache.reset()
        self.forwards = self.fed = self.widest = 0
        self.cover(None)

    def cover(self, k: Optional[int]) -> None:
        """Let later passes of all B rows go over the first k images only (None: every one), on a
        view of the cache's first rows (`prefix`; docs/engine.md, "Which rows a pass covers"). An
        image left out gets a copy of image 0's outputs (a valid distribution: its stand-in goes
        on drawing tokens) and its cache is not written."""
        self.covered = self.batch if k is None else min(k, self.batch)

    def prefix(self, k: int) -> "ModelRunner":
        """The runner of the first k images of this cache, on a view of it (what it writes is
        written here), made once per k and kept."""
        if k not in self._prefixes:
            self._prefixes[k] = self._sibling(k, self.cache.prefix(k))
        view = self._prefixes[k]
        view.cache.prefix_len = self.cache.prefix_len     # (set by a prefill of prompts)
        return view

    def part_size(self, k: int) -> int:
        """How many images the part that holds k of the B rows has (`part`): k (an eager pass takes
        any shape; a compiled runner rounds up to a power of two, one graph per size)."""
        return k

    def part(self, k: int) -> "ModelRunner":
        """A runner of the same kind, model and sampling for k images (a `part_size`) on a cache
        apart from this one's, their rows copied in (`SlotKVCache.take_images`) and back
        (`put_images`): `apart`, a prefill of some rows. Every k shares one spare cache, made on
        first use, of which it is a view (docs/engine.md, "Rows started apart from the batch")."""
        most = self.part_size(self.batch - 1)
        if not 1 <= k <= most:
            raise ValueError(f"a part holds 1 to {most} images, got {k}")
        if self._spare is None:
            self._spare = self._sibling(most)
        return self._spare.prefix(k)

    def _sibling(self, k: int, cache=None) -> "ModelRunner":
        return ModelRunner(self.model, self.sampling, batch=k, backend=self.backend, cache=cache)

    @contextlib.contextmanager
    def apart(self, rows: List[int]):
        """While the block runs, a runner whose first k images are images `rows` (sorted): a `part`
        holding a copy of their rows, copied back at the end (docs/engine.md, "Which rows a pass
        covers"); this runner for every image, and `prefix` (a view) for the first k. A compiled
        runner's part may hold more (`part_size`): its last images copy the first, and passes feed
        it `batch` rows (`pad_with_first`), of which the first k's outputs count."""
        k = len(rows)
        if k == self.batch:
            yield self
            return
        size = self.part_size(k)
        if size == k and rows == list(range(k)):
            yield self.prefix(k)
            return
        index = to_device(rows + rows[:1] * (size - k), self.device, torch.long)
        part = self.part(size)
        part.cache.take_images(self.cache, index)
        try:
            yield part
        finally:
            part.cache.prefix(k).put_images(self.cache, index[:k])

    # ---- the passes ----
    def outputs(self, logits: torch.Tensor, hidden: torch.Tensor) -> Outputs:
        """Outputs from raw [rows, N, V] logits (e.g. the LM head on predicted hidden states)."""
        if self.sampling.guided:
            cond, uncond = split_cfg(logits)
            return Outputs(cond, uncond, hidden)
        return Outputs(logits, None, hidden)

    def prefill(self, classes) -> Outputs:
        """Write the condition; returns the outputs giving the distribution of token 0 ([B, 1, V])."""
        self.forwards += 1
        classes = to_device(classes, self.device) if isinstance(classes, torch.Tensor) else classes.to(self.device)
        out = self.model.prefill(self.cache, classes, backend=self.backend)
        return self.outputs(out.logits, out.hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *, tree_mask=None, write=True) -> Outputs:
        """Feed tokens [B, N] at raster positions [N] or [B, N]; output i is the distribution of the
        token that follows position i in raster order. Under `cover` (and without a tree mask) the
        pass goes over the first k images alone, its outputs spread back to B rows."""
        k = self.covered if tree_mask is None else self.batch
        if k == self.batch:
            return self._forward(tokens, positions, tree_mask=tree_mask, write=write)
        positions = positions.to(self.device)
        count_pass(self, tokens.shape[1])
        out = self.prefix(k)._forward(tokens.to(self.device)[:k], positions[:k] if positions.dim() == 2 else positions,
                                      write=write)
        return self._spread(out, k)

    def _spread(self, out: Outputs, k: int) -> Outputs:
        """Outputs of the first k images -> outputs of all B (an image left out takes image 0's)."""
        source = self._sources.get(k)
        if source is None:
            source = self._sources[k] = to_device(list(range(k)) + [0] * (self.batch - k), self.device, torch.long)
        return out.images(source)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, *, tree_mask=None, write=True) -> Outputs:
        """`forward` over every row of the cache."""
        count_pass(self, tokens.shape[1])
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        out = self.model.forward_tokens(self.cache, tokens, positions, tree_mask=tree_mask, write=write,
                                        backend=self.backend, **self._fast)
        return self.outputs_at(out.logits, out.hidden, positions)

    def outputs_at(self, logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Outputs:
        """`outputs` of a pass's raw logits [rows, N, V] fed at raster `positions` ([N] or [B, N]),
        with LlamaGen's cfg_interval applied (a compiled pass calls it in its graph for `probs`)."""
        o = self.outputs(logits, hidden)
        if self.sampling.has_cfg_interval:
            o = o._replace(uncond=unguided_after_interval(self.sampling, o.cond, o.uncond, positions))
        return o

    def invalidate_where(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """Forget the entries of positions [B, N] where mask [B, N] is set (a different count per
        row; no host read)."""
        if positions.numel():
            self.cache.invalidate_positions(positions, where=mask)

    # ---- functions of tensors kept with the runner ----
    def function(self, key, make: Callable[[], Callable]) -> Callable:
        """The function `make()` returns. A compiled runner compiles it and keeps it under `key`
        (which must name everything the function closes over that may change between decodes:
        the shapes it is called with, a heads module); the eager runner just calls `make()`."""
        return make()

    def token_step(self, exact: bool = False) -> "TokenStep":
        """The AR step on this runner (eager here, compiled on a compiled runner), made once."""
        found = self._token_steps.get(exact)
        if found is None:
            found = self._token_steps[exact] = TokenStep(self, exact)
        return found

    def ar_step(self, grid: torch.Tensor, position: torch.Tensor, rand: torch.Tensor, *, exact: bool = False,
                reach: Optional[int] = None) -> torch.Tensor:
        """`TokenStep.on_grid` over `grid` [B, H*W] (`rand`: its `uniforms`), the values written
        in place; returns the positions advanced. Under `cover` only the first k images step."""
        k = self.covered
        if k == self.batch:
            values, written, moved = self.token_step(exact).on_grid(grid, position, rand, reach=reach)
            grid.scatter_(1, written, values)
            return moved
        count_pass(self, 1)
        rows = grid[:k]        # (a view: the step's values land in the grid)
        values, written, moved = self.prefix(k).token_step(exact).on_grid(rows, position[:k], rand[:k], reach=reach)
        rows.scatter_(1, written, values)
        return torch.cat([moved, position[k:]])

    # ---- distributions through the kernels ----
    def probs(self, o: Outputs) -> torch.Tensor:
        """The sampling distribution [B, N, V] (CFG, temperature, top-k, top-p) of every output (the
        one its pass computed, when it did)."""
        if o.probs is not None:
            return o.probs
        B, N, V = o.cond.shape
        p = pooling.sampling_probs_unchecked(o.cond.reshape(-1, V),
                                             None if o.uncond is None else o.uncond.reshape(-1, V),
                                             self.sampling.args, backend=self.backend)
        return p.view(B, N, V)

    def token_probs(self, o: Outputs, tokens: torch.Tensor, neighbors=None, delta=None):
        """PooledProbs over [B, N]: p(x) of each token x and its neighbour-pooled version."""
        B, N, V = o.cond.shape
        out = pooling.pool_probs_unchecked(o.cond.reshape(-1, V), tokens.reshape(-1).to(o.cond.device), neighbors,
                                           None if o.uncond is None else o.uncond.reshape(-1, V), self.sampling.args,
                                           delta, backend=self.backend)
        return type(out)(*(t.view(B, N) for t in out))


class TokenStep:
    """One AR step of every row of a grid, each at its own raster position (`on_grid`), made by the
    runner's `function` (compiled on a compiled runner). `exact`: the token is the race winner of
    its row's key at its position (`draws.race`), not the inverse CDF of its uniform."""

    def __init__(self, runner: ModelRunner, exact: bool = False):
        self.runner = runner
        model, cache, s, backend = runner.model, runner.cache, runner.sampling, runner.backend
        guided, interval = s.guided, s.has_cfg_interval
        settings = s.args
        fast, takes_reach = runner._fast, runner._takes_reach
        HW = runner.H * runner.W

        def grid_step(grid, position, uniforms, reach=None):
            going = position < HW - 1
            nxt = (position + 1).clamp(max=HW - 1)
            extra = dict(fast, reach=reach) if takes_reach else fast
            out = model.forward_tokens(cache, grid.gather(1, position), position, backend=backend, **extra)
            logits = out.logits[:, -1]
            cond, uncond = split_cfg(logits) if guided else (logits, None)
            if interval:   # LlamaGen's cfg_interval (a tensor comparison: no host read, one graph)
                uncond = torch.where(position > s.cfg_interval, cond, uncond)
            p = pooling.sampling_probs_unchecked(cond, uncond, settings, backend=backend)
            if exact:    # (`uniforms`: the rows' keys [B, 1])
                drawn = race(p, uniforms[:, 0], nxt[:, 0], backend)
            else:
                drawn = verification.sample_residual_unchecked(p, None, uniforms.gather(1, nxt)[:, 0], backend).tokens
            return torch.where(going, drawn.long()[:, None], grid.gather(1, nxt)), nxt, position + going.long()

        self._grid_step = runner.function(("token_step", exact), lambda: grid_step)
        self.compiled = self._grid_step is not grid_step

    def on_grid(self, grid, position, uniforms, reach: Optional[int] = None):
        """Each row of `grid` [B, H*W] int64 feeds its last drawn token at its position [B, 1] (a
        row at the grid's last position feeds it again and keeps its grid) and draws the next with
        its uniform for that position in `uniforms` [B, H*W] (exact: its key, int64 [B, 1]).
        Returns (values, positions [B, 1] written, positions advanced) for the caller to scatter
        into its grid. The gathers and the choice of values are part of the step (compiled: one
        graph), so a step is one call whatever the rows' positions. `reach`: the furthest position
        fed, as a host int, when known; the eager step then reads only the cache prefix up to it,
        the compiled one the whole cache (one shape for every step, so one graph)."""
        count_pass(self.runner, 1)
        if self.compiled:
            return self._grid_step(grid, position, uniforms)
        return self._grid_step(grid, position, uniforms, reach)


__all__ = ["ModelRunner", "Outputs", "TokenStep", "count_pass", "unguided_after_interval", "weights_key"]
