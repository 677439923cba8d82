"""`mulo`: MuLo-SD, multi-scale local speculative decoding (METHODS.md "mulo"), lossy by design.

1. Draft: a same-family drafter on the low-resolution grid (H/r x W/r) samples the whole
   low-resolution image, serially (`drafting="serial"`) or row-staggered (`drafting="zipar"`).
2. Up-sample it to a high-resolution draft x~ (`upsample="pixel" | "learned" | "nearest"`).
3. Verify: one target pass over x~ (a chunked causal prefill that keeps the keys and values).
4. Accept x~_i iff the pooled target probability p(x~_i) + moved neighbour mass >= tau
   (`pool_probs` with `k` neighbours and budget `delta`).
5. Local rejection: R_X = the (2l+1)^2 windows around the rejected positions, from the first
   rejection on (`verify_grid(rule="threshold", mode="local", radius=l)`); accepted tokens outside
   R_X are kept even after the first rejection.
6. Resample R_X with the target: v1 (`resample="raster"`) one token per pass in raster order;
   v2 (`resample="islands"`) the 8-connected islands of R_X concurrently, one token per island per
   pass, unresolved slots of other islands hidden (invalid cache slots and a tree mask).
   Reading: kept tokens' keys and values from the verification pass are reused; the first token
   of the first island is sampled from the verification logits (its context is all accepted).

One cycle per image: after step 6 the grid is complete, so the drafter's prefix is the condition
alone (the down-sampled-prefix path of multi-cycle MuLo-SD is not exercised; see `downsample`).
Target passes per image: prefill + verification + the resampling passes.
"""
from __future__ import annotations

import math

import torch

from specdec import masks
from specdec.decoding import upsample as _up
from specdec.decoding.ar import sample_grid
from specdec.decoding.common import (ModelRunner, Outputs, Sampling, check_grid_model, draw, run_batches, verify)
from specdec.decoding.lantern import check_delta, neighbor_table
from specdec.decoding.zipar import check_window, zipar_grid

DRAFTING = ("serial", "zipar")
RESAMPLING = ("islands", "raster")


def check_tau(tau) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"tau must be a finite number >= 0 (tau > 1 rejects every draft), got {tau!r}")
    return float(tau)


def check_models(target, drafter):
    check_grid_model(target, "target")
    check_grid_model(drafter, "drafter")
    (H, W), (h, w) = tuple(target.grid), tuple(drafter.grid)
    if H % h or W % w or H // h != W // w or H // h < 1:
        raise ValueError(f"drafter grid {(h, w)} must divide the target grid {(H, W)} by the same factor r per side")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}: "
                         "MuLo-SD needs one shared codebook")
    return H // h


@torch.no_grad()
def resample_raster(runner: ModelRunner, x: torch.Tensor, ver: Outputs, rpos: torch.Tensor, gen):
    """v1: R_X positions (sorted) one per pass; each pass feeds the token resolved last and the
    token just before the next position (re-encoding a kept token with the corrected context)."""
    x[0, rpos[0]] = draw(runner.probs(ver.select(rpos[0:1]))[:, 0], gen, runner.backend)[0]
    prev = int(rpos[0])
    for u in rpos[1:].tolist():
        block = sorted({prev, u - 1})
        pos = torch.tensor(block, device=x.device)
        out = runner.forward(x[:, pos], pos)
        x[0, u] = draw(runner.probs(out.select(slice(-1, None)))[:, 0], gen, runner.backend)[0]
        prev = u


@torch.no_grad()
def resample_islands(runner: ModelRunner, x: torch.Tensor, ver: Outputs, resample: torch.Tensor,
                     islands: torch.Tensor, gen):
    """v2: every island of R_X advances one token per pass, all islands in one pass."""
    dev = x.device
    HW = x.shape[1]
    rpos = resample.nonzero()[:, 0]
    label = islands[rpos].long()
    order = torch.argsort(label * HW + rpos)
    rpos, label = rpos[order], label[order]
    first_of = torch.ones_like(label, dtype=torch.bool)
    first_of[1:] = label[1:] != label[:-1]
    start_idx = torch.cummax(torch.where(first_of, torch.arange(len(label), device=dev), torch.zeros_like(label)), 0).values
    rank = torch.arange(len(label), device=dev) - start_idx
    resolved = ~resample.clone()
    t0 = int(resample.nonzero()[0, 0])          # the first rejection: R_X starts there
    last = torch.empty(0, dtype=torch.long, device=dev)          # tokens resolved in the previous pass
    for m in range(int(rank.max()) + 1):
        now = rpos[rank == m]                                     # one position per active island
        if m == 0 and bool((now == t0).any()):
            # The first island starts at the first rejection: its context is all accepted.
            x[0, t0] = draw(runner.probs(ver.select(slice(t0, t0 + 1)))[:, 0], gen, runner.backend)[0]
            resolved[t0] = True
            now = now[now != t0]
            last = torch.tensor([t0], device=dev)
            if now.numel() == 0:
                continue
        pos = torch.unique(torch.cat([last, now - 1]))            # sorted, deduplicated
        trusted = resolved[pos]
        tree = None
        if not bool(trusted.all()):
            # A query slot of another island's unresolved token: visible to its own query only.
            n = pos.numel()
            eye = torch.eye(n, dtype=torch.bool, device=dev)
            tree = masks.pack((trusted[None, :] | eye)[None].expand(runner.cache.rows, n, n).contiguous())
        out = runner.forward(x[:, pos], pos, tree_mask=tree)
        if tree is not None:
            runner.invalidate(pos[~trusted])
        src = torch.searchsorted(pos, now - 1)
        x[0, now] = draw(runner.probs(out.select(src))[0], gen, runner.backend)
        resolved[now] = True
        last = now


def decode(target, classes, *, drafter, tokenizer=None, upsample: str = "pixel", upsampler=None,
           codebook=None, neighbors=None, tau: float = 0.05, k: int = 1000, delta: float = 0.4, radius: int = 1,
           drafting: str = "serial", window: int = 2, resample: str = "islands", seed: int = 0,
           sampling: Sampling = Sampling(), draft_sampling: Sampling = None, backend=None, progress=None):
    """MuLo-SD on `target` with the low-resolution `drafter`. `draft_sampling` defaults to `sampling`."""
    if drafter is None:
        raise ValueError("mulo needs a low-resolution drafter (drafter=...)")
    factor = check_models(target, drafter)
    tau = check_tau(tau)
    delta = check_delta(delta)
    if isinstance(radius, bool) or not isinstance(radius, int) or radius < 0:
        raise ValueError(f"radius must be an int >= 0, got {radius!r}")
    if drafting not in DRAFTING:
        raise ValueError(f"drafting must be one of {', '.join(DRAFTING)}, got {drafting!r}")
    if resample not in RESAMPLING:
        raise ValueError(f"resample must be one of {', '.join(RESAMPLING)}, got {resample!r}")
    if upsample not in _up.MODES:
        raise ValueError(f"upsample must be one of {', '.join(_up.MODES)}, got {upsample!r}")
    if drafting == "zipar":
        check_window(window, drafter.grid[1])
    if upsample == "pixel" and tokenizer is None:
        raise ValueError("upsample='pixel' needs the VQ tokenizer (tokenizer=...)")
    if upsample == "learned" and upsampler is None:
        raise ValueError("upsample='learned' needs the trained up-sampler (upsampler=...)")
    if upsample == "learned" and (upsampler.codebook.shape[0] != target.vocab_size or upsampler.factor != factor):
        raise ValueError(f"the learned up-sampler maps {upsampler.codebook.shape[0]} codes by factor {upsampler.factor}; "
                         f"this target has {target.vocab_size} codes and factor {factor}")
    if neighbors is None and codebook is not None and k > 0:
        neighbors = neighbor_table(codebook, k)
    draft_sampling = draft_sampling or sampling
    h, w = drafter.grid

    def run(cls, gen, stats):
        drunner = ModelRunner(drafter, draft_sampling, batch=1, backend=backend)
        if drafting == "serial":
            low = sample_grid(drunner, cls, gen)
        else:
            low = zipar_grid(drunner, cls, gen, window=window)
        xt = _up.upsample(low.view(1, h, w), factor, upsample, tokenizer=tokenizer, net=upsampler)
        runner = ModelRunner(target, sampling, batch=1, backend=backend)
        H, W = runner.H, runner.W
        x = xt.reshape(1, H * W).to(runner.device)
        first = runner.prefill(cls)
        out = runner.forward(x[:, :-1], torch.arange(H * W - 1, device=runner.device))
        ver = Outputs.cat([first, out])                                  # distribution of every token
        pooled = runner.token_probs(ver, x, neighbors, delta if neighbors is not None else None).pooled
        verdict = verify(pooled.view(1, H, W), rule="threshold", tau=tau, mode="local", radius=radius,
                         backend=backend)
        stats.acceptance_maps.append(verdict.accept.cpu())
        stats.extra.setdefault("islands", []).append(verdict.islands[0].cpu())
        stats.extra.setdefault("num_islands", []).append(int(verdict.num_islands[0]))
        stats.extra.setdefault("resampled", []).append(int(verdict.resample.sum()))
        stats.extra.setdefault("low_res", []).append(low.view(h, w).cpu())
        R = verdict.resample.view(-1)
        if bool(R.any()):
            runner.invalidate(R.nonzero()[:, 0])
            if resample == "raster":
                resample_raster(runner, x, ver, R.nonzero()[:, 0], gen)
            else:
                resample_islands(runner, x, ver, R, verdict.islands.view(-1), gen)
        stats.target_forwards = runner.forwards
        stats.draft_forwards = drunner.forwards
        return x

    return run_batches("mulo", target, classes, seed, run, batch_size=1, tokenizer=tokenizer, progress=progress)
