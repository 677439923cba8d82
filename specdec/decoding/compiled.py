"""Decoder steps through `torch.compile`: one model pass plus the sampling that follows it, as a
function of tensors only, so the compiler sees the whole step as one graph (docs/engine.md,
"Compiled steps"). Inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`, by default under the
system temporary directory) makes later runs skip most of the compilation.
"""
from __future__ import annotations

import threading
import time
import types
from typing import Callable, Dict, Optional, Tuple

import torch

from specdec import masks
from specdec.decoding.blocks import power_of_two
from specdec.decoding.runner import ModelRunner, count_pass, weights_key
from specdec.numerics import batch_invariant_enabled


def compile_step(fn: Callable, device: torch.device, graphs: bool = True) -> Callable:
    """`fn` compiled for `device` without graph breaks (fullgraph=True: a break is an error, not
    a silent slow path), for the one shape it will be called with: without Dynamo's guards (on
    this model family about an eighth of a step's time), as its own copy of the code object
    (Dynamo keeps compiled entries per code object, and would otherwise test the guards of every
    width in turn); `graphs`: replayed as a CUDA graph on CUDA."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, fullgraph=True, dynamic=False, options=compile_options(device, graphs))


def compile_options(device: torch.device, graphs: bool = True) -> dict:
    """torch.compile's options for a step on `device`: no guards, and on CUDA with `graphs` the CUDA
    graphs of mode="reduce-overhead" (torch.compile takes a mode or options, not both)."""
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    if device.type == "cuda" and graphs:
        options["triton.cudagraphs"] = True
    return options


def bucket_width(n: int) -> int:
    """The padded width of a pass of n tokens: the smallest of 1, 2, 4, 8, then the multiples of 8
    up to 64, then 96, 128, 192, 256, ... (powers of two and 1.5 times them) that holds n, as a
    serving engine pads its batches to a few graph sizes. Up to 64 tokens at most 7 are padding
    (SSD's spans of 17-64 tokens, where the 1.5x steps padded up to a third: 9-11% of its
    compiled time on a 2-core CPU, docs/experiments.md), beyond it at most a third, and a decode
    meets a handful of widths."""
    if n < 1:
        raise ValueError(f"a pass needs at least one token, got {n}")
    if n <= 8:
        return power_of_two(n)
    if n <= 64:
        return -(-n // 8) * 8
    width = 64
    while True:
        for w in (width * 3 // 2, width * 2):
            if w >= n:
                return w
        width *= 2


class CompiledFunction:
    """`fn(*tensors)` compiled for one set of input shapes (no guards: docs/engine.md, "Compiled
    steps"): its tensor inputs are made contiguous, as traced (None passes as it is). The first
    call compiles (timed in `compile_s`). `compiler(fn, device)`: as `CompiledRunner`'s."""

    compile_s = 0.0

    def __init__(self, fn: Callable, device: torch.device, graphs: bool = True, compiler: Callable = None):
        self._fn = compiler(fn, device) if compiler is not None else compile_step(fn, device, graphs)
        self._graphs = graphs and device.type == "cuda"   # CUDA-graph replays
        self._calls = 0

    def __call__(self, *tensors, columns: Optional[int] = None):
        """`columns`: only the first that many columns of each output are kept (and copied)."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
        out = self._fn(*(None if t is None else t.contiguous() for t in tensors))
        if self._calls == 0:
            self.compile_s += time.perf_counter() - start
        self._calls += 1
        if columns is not None:
            out = tuple(t[:, :columns] for t in out)
        if self._graphs:
            out = tuple(t.clone() for t in out)   # a replay reuses its output memory
        return out

    def take_compile_s(self) -> float:
        """The compile time not reported yet (0 once reported)."""
        seconds, self.compile_s = self.compile_s, 0.0
        return seconds


class CompiledForward:
    """A model's target pass (`forward_tokens` on the fast path) through compiled graphs, one per
    (padded width, tree mask or not, write or not), made on first use and kept.

    A pass of N tokens is padded to `bucket_width(N)` by feeding its last token again at its own
    position, with that token's view: written in place, a copy sees what the token sees (the cache
    at positions up to its own) and writes the token's keys and values at its slot again; in a
    block attended without writing in place (a tree mask, or `write=False`), a tree mask hides the
    copies from the real queries and gives each copy the last real row's mask. So the real outputs
    and the cache are those of the unpadded pass (with row-by-row products and one attention
    product per query: bit for bit for in-place passes, to float32 rounding for a block, whose
    softmax sums the masked copies' zeros too; tested).

    A call returns (logits [rows, N, V], hidden [rows, N, dim], probs [B, N, V]), cut back to the
    N real columns (only those are copied after a CUDA-graph replay, which reuses its output
    memory); probs are made inside the graph by `distribution`."""

    def __init__(self, model, cache, backend, fast: dict, distribution: Callable, compiler: Callable = None,
                 graphs: bool = True):
        self.model, self.cache, self.backend = model, cache, backend
        # `distribution(logits, hidden, positions) -> probs [B, N, V]`: made inside each graph too
        # (the runner's `probs` of its `outputs_at`): one eager call less per pass.
        self.distribution = distribution
        self.fast = fast   # the runner's fast-path keywords of forward_tokens
        self.graphs = graphs and cache.device.type == "cuda"   #: passes replayed as CUDA graphs
        self.compiler = compiler   # `compiler(fn, device)`: as `CompiledRunner`'s
        self._graphs: Dict[Tuple[int, bool, bool], CompiledFunction] = {}
        self._columns: Dict[Tuple[int, int], torch.Tensor] = {}
        if self.graphs:   # static addresses: CUDA graphs replay the cache's in-place writes
            for t in [*cache.k, *cache.v, cache.valid]:
                torch._dynamo.mark_static_address(t)

    def _graph(self, key):
        graph = self._graphs.get(key)
        if graph is None:
            write = key[2]   # the mask's presence is fixed by tracing with or without one
            model, cache, backend, fast, dist = self.model, self.cache, self.backend, self.fast, self.distribution

            def forward(tokens, positions, tree_mask):
                out = model.forward_tokens(cache, tokens, positions, tree_mask=tree_mask, write=write, backend=backend,
                                           **fast)
                return out.logits, out.hidden, dist(out.logits, out.hidden, positions)

            graph = self._graphs[key] = CompiledFunction(forward, cache.device, self.graphs, self.compiler)
        return graph

    def _tree_mask(self, tree_mask, rows: int, n: int, width: int):
        """The mask of the padded block: the caller's rows (without one: every real column)
        restricted to the real columns; padding rows copy the last real row (class docstring)."""
        key = (n, width)
        if key not in self._columns:   # the packed row whose bits 0..n-1 (the real columns) are set
            self._columns[key] = masks.pack(torch.arange(width, device=self.cache.device) < n)
        columns = self._columns[key]
        if tree_mask is None:
            return columns.expand(rows, width, -1).contiguous()
        padded = columns.expand(rows, width, -1).clone()
        padded[:, :n, :tree_mask.shape[2]] &= tree_mask
        padded[:, n:] = padded[:, n - 1:n]
        return padded

    def __call__(self, tokens, positions, tree_mask=None, write: bool = True):
        rows, n = tokens.shape
        width = bucket_width(n)
        if positions.dim() == 1:
            positions = positions.expand(rows, n)
        if width > n:
            pad = width - n
            tokens = torch.cat([tokens, tokens[:, -1:].expand(rows, pad)], 1)
            positions = torch.cat([positions, positions[:, -1:].expand(positions.shape[0], pad)], 1)
            if tree_mask is not None or not write:
                tree_mask = self._tree_mask(tree_mask, tree_mask.shape[0] if tree_mask is not None else rows,
                                            n, width)
        # (the graph was traced on contiguous inputs and keeps no guards: a strided view, a slice of
        # the token grid, would fail inductor's stride assertion; `CompiledFunction` makes them so)
        return self._graph((width, tree_mask is not None, write))(tokens, positions, tree_mask, columns=n)

    def take_compile_s(self) -> float:
        """The compile time of its graphs not reported yet."""
        return sum(graph.take_compile_s() for graph in self._graphs.values())


class CompiledRunner(ModelRunner):
    """A ModelRunner whose passes go through compiled graphs: target passes through
    `CompiledForward`, the class-conditional prefill when the model allows it
    (`compilable_prefill`), the AR step (`token_step`) and the small computations between passes
    (`function`: SSD's head drafts) each as a `CompiledFunction` kept with the runner. Made once
    per model, batch size and sampling by `compiled_runner` and reused by later decodes."""

    def __init__(self, model, sampling, *, batch: int = 1, backend=None, compiler: Callable = None,
                 graphs: bool = True, cache=None):
        """`compiler(fn, device)`: how the target passes are compiled (default `compile_step`; the
        tests pass the identity to check the padding with eager numerics). `graphs`: on CUDA,
        every compiled function is replayed as a CUDA graph. `cache`: `ModelRunner`'s."""
        super().__init__(model, sampling, batch=batch, backend=backend, cache=cache)
        self.graphs = graphs
        self._compiler = compiler
        self.compiled_forward = CompiledForward(model, self.cache, backend, self._fast, self._distribution,
                                                compiler=compiler, graphs=graphs)
        #: compiled functions kept with the runner, by key (`function`)
        self.functions: Dict[object, CompiledFunction] = {}

    def _distribution(self, logits, hidden, positions):
        """What a compiled pass makes in its graph beside its logits: `probs` of `outputs_at`."""
        return self.probs(self.outputs_at(logits, hidden, positions))

    def prefill(self, classes):
        if not (isinstance(classes, torch.Tensor) and getattr(self.model, "compilable_prefill", False)):
            return super().prefill(classes)
        self.forwards += 1
        model, cache, backend = self.model, self.cache, self.backend

        def make():
            def prefill(c):
                return tuple(model.prefill(cache, c, backend=backend))
            return prefill
        classes = classes.to(self.device)
        return self.outputs(*self.function(("prefill", tuple(classes.shape)), make)(classes))

    def _forward(self, tokens, positions, *, tree_mask=None, write=True):
        count_pass(self, tokens.shape[1])
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        logits, hidden, probs = self.compiled_forward(tokens, positions, tree_mask, write)
        return self.outputs_at(logits, hidden, positions)._replace(probs=probs)

    def part_size(self, k: int) -> int:
        return min(power_of_two(k), self.batch)

    def _sibling(self, k: int, cache=None) -> "CompiledRunner":
        return CompiledRunner(self.model, self.sampling, batch=k, backend=self.backend, compiler=self._compiler,
                              graphs=self.graphs, cache=cache)

    def function(self, key, make):
        found = self.functions.get(key)
        if found is None:
            found = self.functions[key] = CompiledFunction(make(), self.device, self.graphs)
        return found

    def take_compile_s(self) -> float:
        """The compile time of every graph of the runner not reported yet."""
        parts = [self.compiled_forward, *self.functions.values()]
        return (sum(part.take_compile_s() for part in parts)
                + sum(r.take_compile_s() for r in [*self._prefixes.values(), self._spare] if r is not None))


#: How many compiled runners a model keeps, the most recently used: each holds a cache of its batch
#: (and a spare), so a sweep of samplings or batch sizes (guidance scales for a quality curve)
#: would otherwise keep one per setting for the life of the model.
KEPT_RUNNERS = 4
#: Where a model keeps them (in its `__dict__`), and the lock of every model's store: decodes may
#: run in several threads.
_STORE = "_specdec_compiled_runners"
_STORES_LOCK = threading.Lock()


def compiled_runner(model, sampling, batch: int, backend=None, *, graphs: bool = True,
                    held: Optional[dict] = None, role: str = "target") -> CompiledRunner:
    """The CompiledRunner of `model` for this batch size and sampling, made once and kept on the
    model among its last KEPT_RUNNERS (later decodes reset the same runner: same cache tensors, so
    the graphs are reused, and on CUDA replay into the same addresses). `held`: the runners a decode
    holds (`put_back` at its end): a runner it holds is out of the model's store, so that a decode
    in another thread meanwhile makes its own instead of writing into the same cache (both images
    went wrong). A streaming engine holds its runners for its life (its batch lives across steps
    while other decodes of the model run), never putting them back. `role`: a model that is its
    own drafter (`sd` with drafter=target) has a runner, and a cache, per role, as when eager."""
    # What the graphs were made for (they keep no guards): the batch, sampling, backend and graphs,
    # and what the model's numerics depend on (its parameters' dtype and device, batch invariance).
    key = (batch, sampling, backend, weights_key(model), batch_invariant_enabled(), graphs, role)
    # (a decode's runners are of several models: the target's, the drafter's)
    wide_key = (id(model),) + key
    if held is not None and wide_key in held:
        runner = held[wide_key][2]
    else:
        with _STORES_LOCK:
            runner = model.__dict__.setdefault(_STORE, {}).pop(key, None)
        if runner is None:
            runner = CompiledRunner(model, sampling, batch=batch, backend=backend, graphs=graphs)
        if held is None:    # (kept at once: a caller without a decode's bookkeeping, one thread)
            put_back({wide_key: (model, key, runner)})
        else:
            held[wide_key] = (model, key, runner)
    runner.reset()
    return runner


def put_back(held: dict) -> None:
    """The runners a decode held (`compiled_runner`'s `held`), back in their models' stores for the
    next decode: the most recently used last, at most KEPT_RUNNERS each (one another thread made
    meanwhile for the same key gives way)."""
    with _STORES_LOCK:
        for model, key, runner in held.values():
            store = model.__dict__.setdefault(_STORE, {})
            store.pop(key, None)
            store[key] = runner
            while len(store) > KEPT_RUNNERS:
                del store[next(iter(store))]
    held.clear()


def runner_for(model, sampling, batch: int, backend=None, *, compile: bool = False, graphs: bool = True,
               held: Optional[dict] = None, role: str = "target") -> ModelRunner:
    """The runner a decoder uses for `model` in `role`: a fresh eager one, or with `compile` the
    model's kept compiled one (`held` by the decode: `compiled_runner`)."""
    if compile:
        return compiled_runner(model, sampling, batch, backend, graphs=graphs, held=held, role=role)
    return ModelRunner(model, sampling, batch=batch, backend=backend)


__all__ = ["CompiledForward", "CompiledFunction", "CompiledRunner", "bucket_width", "compile_step", "compiled_runner",
           "put_back", "runner_for"]
