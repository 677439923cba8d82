"""Decoder steps through `torch.compile`: one model pass plus the sampling that follows it, as a
function of tensors only, so the compiler sees the whole step as one graph.

On CPU the step is compiled by inductor (C++ kernels, the specdec ops called from the graph
through their registered fake implementations); on CUDA with `mode="reduce-overhead"`, i.e. CUDA
graphs, with the KV cache marked as a static address so that its in-place writes can be replayed.
Shapes are static (one token per row, the whole slot cache as keys), so one graph serves every
step of a decode, and inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`, by default under the
system temporary directory) makes later runs skip most of the compilation.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from specdec.decoding import kernels


def check_compile(compile) -> bool:
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    return compile


def compile_step(fn: Callable, device: torch.device) -> Callable:
    """`fn` compiled for `device` without graph breaks (fullgraph=True: a break is an error, not
    a silent slow path)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)


def mark_cache_static(cache) -> None:
    """Tell the compiler that the cache tensors keep their addresses (CUDA graphs replay writes
    into them)."""
    for t in list(cache.k) + list(cache.v) + [cache.valid]:
        torch._dynamo.mark_static_address(t)


class TokenStep:
    """Feed one token per row at one raster position and sample the next: the AR step.

    `step(tokens [B, 1] int64, position [1] int64, uniforms [B] float32) -> next tokens [B] int64`,
    eager or compiled. The first compiled call compiles (timed in `compile_s`)."""

    def __init__(self, runner, *, compile: bool = False):
        self.runner = runner
        self.compiled = compile
        self.compile_s = 0.0
        self._calls = 0
        model, cache, s, backend = runner.model, runner.cache, runner.sampling, runner.backend
        guided = s.guided
        interval = s.has_cfg_interval

        def step(tokens, position, uniforms, reach=None):
            out = model.forward_tokens(cache, tokens, position, backend=backend, checked=False, reach=reach)
            logits = out.logits[:, -1]
            cond, uncond = logits.chunk(2) if guided else (logits, None)
            if interval:   # LlamaGen's cfg_interval (a tensor comparison: no host read, one graph)
                uncond = torch.where(position > s.cfg_interval, cond, uncond)
            p = kernels.sampling_probs(cond, uncond, s, backend)
            return kernels.sample_residual(p, None, uniforms, backend).tokens.long()

        if compile:
            if cache.device.type == "cuda":
                mark_cache_static(cache)
            step = compile_step(step, cache.device)
        self._step = step

    def __call__(self, tokens, position, uniforms, reach: Optional[int] = None):
        """`reach`: the position as a host int, when the caller knows it (AR's loop index). The
        eager step then reads only the cache prefix up to it; the compiled step ignores it and
        reads the whole cache (one shape for every step, so one graph)."""
        self.runner.forwards += 1
        if not self.compiled:
            return self._step(tokens, position, uniforms, reach)
        if self._calls == 0:
            start = time.perf_counter()
            out = self._step(tokens, position, uniforms)
            self.compile_s = time.perf_counter() - start
        else:
            out = self._step(tokens, position, uniforms)
        self._calls += 1
        return out

    def take_compile_s(self) -> float:
        """The compile time not reported yet (the first call's; 0 once reported)."""
        seconds, self.compile_s = self.compile_s, 0.0
        return seconds


def compiled_token_step(model, sampling, batch: int, backend=None):
    """(runner, TokenStep) compiled for `model` at this batch size and sampling, made once and kept
    on the model: later decodes reset the same runner (same cache tensors), so the compiled graph
    is reused instead of traced again for every new cache (and, on CUDA, the graph replays into
    the same addresses). Returns the runner reset for a new batch."""
    from specdec.decoding.common import ModelRunner

    store = model.__dict__.setdefault("_specdec_compiled_steps", {})
    key = (batch, sampling, backend)
    if key not in store:
        runner = ModelRunner(model, sampling, batch=batch, backend=backend)
        store[key] = (runner, TokenStep(runner, compile=True))
    runner, step = store[key]
    runner.reset()
    return runner, step


__all__ = ["TokenStep", "compile_step", "compiled_token_step", "check_compile", "mark_cache_static"]
