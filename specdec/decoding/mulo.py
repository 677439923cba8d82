"""`mulo`: MuLo-SD, multi-scale local speculative decoding (docs/decoders.md, "mulo"), lossy by design.

1. Draft: a same-family drafter on the low-resolution grid (H/r x W/r) samples the next
   `cycle_rows` low-resolution rows (reading, the default `cycle_rows=None`: the whole image in one
   cycle), serially (`drafting="serial"`) or row-staggered (`drafting="zipar"`, whole image only).
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

7. With `cycle_rows` set, the next cycle's drafter prefix is the accepted image so far, down-sampled
   (VQ decode, area-resize by 1/r, VQ encode, the cut edge-padded; `upsample.downsample`) and fed to the drafter in one
   pass, so its next rows continue what the target kept rather than its own rejected draft.
   Each cycle verifies only its own r * cycle_rows high-resolution rows (the rows above are
   committed); its islands and local windows live inside them.

Target passes per image: prefill + one verification per cycle + the resampling passes.
"""
from __future__ import annotations

import math

import torch

from specdec import masks
from specdec.decoding import upsample as _up
from specdec.decoding.ar import sample_grid
from specdec.decoding.compiled import check_compile, compiled_token_step
from specdec.decoding.common import (ModelRunner, Outputs, Sampling, check_grid_model, draw, one_image_at_a_time,
                                     run_batches, verify)
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
def resample_raster(runner: ModelRunner, x: torch.Tensor, ver: Outputs, rpos: list, gen, base: int = 0) -> list:
    """v1: R_X positions (sorted host ints) one per pass; each pass feeds the token resolved last
    and the token just before the next position (re-encoding a kept token with the corrected
    context). `ver` holds the verification outputs of positions base, base + 1, ... Returns the
    position resolved last (a host list), whose keys and values are not written yet. The schedule
    is known from R_X alone, so the passes read nothing back."""
    dev = x.device
    first = torch.tensor(rpos[:1], dtype=torch.long, device=dev)
    x[0, first] = draw(runner.probs(ver.select(first - base))[:, 0], gen, runner.backend)
    prev = rpos[0]
    for u in rpos[1:]:
        pos = torch.tensor(sorted({prev, u - 1}), dtype=torch.long, device=dev)
        out = runner.forward(x[:, pos], pos)
        x[0, u] = draw(runner.probs(out.select(slice(-1, None)))[:, 0], gen, runner.backend)[0]
        prev = u
    return [prev]


def island_schedule(resample: list, islands: list) -> list:
    """The passes of v2 from R_X (host bools over the grid) and its island labels (host ints):
    pass m resolves the m-th position (raster order) of every island with more than m, the
    islands in label order."""
    by_island = {}
    for t, r in enumerate(resample):
        if r:
            by_island.setdefault(islands[t], []).append(t)
    order = [by_island[label] for label in sorted(by_island)]
    depth = max(map(len, order), default=0)
    return [[island[m] for island in order if m < len(island)] for m in range(depth)]


@torch.no_grad()
def resample_islands(runner: ModelRunner, x: torch.Tensor, ver: Outputs, resample: list, islands: list,
                     gen, base: int = 0) -> list:
    """v2: every island of R_X advances one token per pass, all islands in one pass. `resample`
    (bools) and `islands` (labels) cover the whole grid, on the host: the passes' positions,
    masks and draw counts follow from them alone, so the passes read nothing back. `ver` holds
    the outputs of positions base, base + 1, ... Returns the positions resolved in the last pass
    (a host list), whose keys and values are not written yet."""
    dev = x.device
    resolved = [not r for r in resample]
    t0 = resample.index(True)                    # the first rejection: R_X starts there
    last = []                                    # tokens resolved in the previous pass
    for m, now in enumerate(island_schedule(resample, islands)):
        if m == 0 and t0 in now:
            # The first island starts at the first rejection: its context is all accepted.
            x[0, t0] = draw(runner.probs(ver.select(slice(t0 - base, t0 - base + 1)))[:, 0], gen, runner.backend)[0]
            resolved[t0] = True
            now = [u for u in now if u != t0]
            last = [t0]
            if not now:
                continue
        block = sorted(set(last) | {u - 1 for u in now})
        pos = torch.tensor(block, dtype=torch.long, device=dev)
        trusted = [resolved[t] for t in block]
        tree = None
        if not all(trusted):
            # A query slot of another island's unresolved token: visible to its own query only.
            n = len(block)
            eye = torch.eye(n, dtype=torch.bool, device=dev)
            seen = torch.tensor(trusted, dtype=torch.bool, device=dev)
            tree = masks.pack((seen[None, :] | eye)[None].expand(runner.cache.rows, n, n).contiguous())
        out = runner.forward(x[:, pos], pos, tree_mask=tree)
        if tree is not None:
            runner.invalidate(torch.tensor([t for t, ok in zip(block, trusted) if not ok], dtype=torch.long,
                                           device=dev))
        src = torch.tensor([block.index(u - 1) for u in now], dtype=torch.long, device=dev)
        x[0, torch.tensor(now, dtype=torch.long, device=dev)] = draw(runner.probs(out.select(src))[0], gen,
                                                                     runner.backend)
        for u in now:
            resolved[u] = True
        last = now
    return last


def check_cycle_rows(cycle_rows, low_height: int, drafting: str):
    if cycle_rows is None:
        return low_height
    if isinstance(cycle_rows, bool) or not isinstance(cycle_rows, int) or not 1 <= cycle_rows <= low_height:
        raise ValueError(f"cycle_rows must be None (whole image) or an int in [1, {low_height}] "
                         f"(the drafter's grid height), got {cycle_rows!r}")
    if drafting == "zipar" and cycle_rows < low_height:
        raise ValueError("drafting='zipar' drafts the whole low-resolution image; cycle_rows needs drafting='serial'")
    return cycle_rows


def decode(target, classes, *, drafter, tokenizer=None, upsample: str = "pixel", upsampler=None,
           codebook=None, neighbors=None, tau: float = 0.05, k: int = 1000, delta: float = 0.4, radius: int = 1,
           drafting: str = "serial", window: int = 2, resample: str = "islands", cycle_rows=None, seed: int = 0, first_index: int = 0,
           sampling: Sampling = Sampling(), draft_sampling: Sampling = None, backend=None, progress=None,
           batch_size: int = 1, compile: bool = False):
    """MuLo-SD on `target` with the low-resolution `drafter`. `draft_sampling` defaults to `sampling`;
    `cycle_rows` low-resolution rows are drafted per cycle (None: the whole image, one cycle).
    `compile=True` runs the drafter's serial AR steps compiled (specdec.decoding.compiled, as
    compiled `ar` runs its own); the target's verification and resampling passes stay eager (their
    shapes follow the islands), so this is a partial treatment: compare it with compiled `ar`.
    Islands differ per image, so a batch is decoded one image at a time (batch_size is accepted;
    each image draws from its own stream, so tokens equal batch_size=1)."""
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
    h, w = drafter.grid
    cycle_rows = check_cycle_rows(cycle_rows, h, drafting)
    if upsample == "pixel" and tokenizer is None:
        raise ValueError("upsample='pixel' needs the VQ tokenizer (tokenizer=...)")
    if cycle_rows < h and tokenizer is None:
        raise ValueError("cycle_rows < the drafter's grid height needs the VQ tokenizer (tokenizer=...) to "
                         "down-sample the accepted rows into the drafter's next prefix")
    if upsample == "learned" and upsampler is None:
        raise ValueError("upsample='learned' needs the trained up-sampler (upsampler=...)")
    if upsample == "learned" and (upsampler.codebook.shape[0] != target.vocab_size or upsampler.factor != factor):
        raise ValueError(f"the learned up-sampler maps {upsampler.codebook.shape[0]} codes by factor {upsampler.factor}; "
                         f"this target has {target.vocab_size} codes and factor {factor}")
    if neighbors is None and codebook is not None and k > 0:
        neighbors = neighbor_table(codebook, k)
    draft_sampling = draft_sampling or sampling
    compile = check_compile(compile)
    if compile and drafting != "serial":
        raise ValueError("compile=True compiles the serial drafter's steps; drafting='zipar' has none")

    def run(cls, gen, stats):
        if compile:
            drunner, dstep = compiled_token_step(drafter, draft_sampling, 1, backend)
        else:
            drunner, dstep = ModelRunner(drafter, draft_sampling, batch=1, backend=backend), None
        runner = ModelRunner(target, sampling, batch=1, backend=backend)
        H, W = runner.H, runner.W
        x = torch.zeros(1, H * W, dtype=torch.long, device=runner.device)
        low = torch.zeros(1, h * w, dtype=torch.long, device=drunner.device)  # the drafter's view of the image
        drafts = low.clone()                                                  # what it drafted, for the maps
        accept_map = torch.zeros(H * W, dtype=torch.bool)
        island_map = torch.full((H * W,), -1, dtype=torch.int32)
        first = runner.prefill(cls)
        dstart = drunner.prefill(cls) if drafting == "serial" else None   # zipar_grid prefills itself
        cycles = resampled = 0
        unfed = []                      # resolved by the last pass, keys unwritten (host ints)
        for done in range(0, h, cycle_rows):                 # low-resolution rows committed so far
            rows = min(cycle_rows, h - done)
            lo, hi = done * w, (done + rows) * w
            if done:
                # 7. The drafter continues from the down-sampled accepted image (one prefix pass).
                prefix = _up.downsample(x.view(1, H, W)[:, :done * factor].cpu(), factor, tokenizer=tokenizer, pad_to=H)
                low[:, :lo] = prefix.reshape(1, lo).to(low.device)
                dstart = drunner.forward(low[:, :lo], torch.arange(lo, device=low.device)).select(slice(-1, None))
            if drafting == "serial":
                sample_grid(drunner, cls, gen, start_out=dstart, x=low, start=lo, end=hi, step=dstep)
            else:
                low.copy_(zipar_grid(drunner, cls, gen, window=window))
            drafts[:, lo:hi] = low[:, lo:hi]
            # 2. Up-sample (row-causal for `learned`: rows above the block come out as they would
            # have; the block's rows are what is drafted).
            up = _up.upsample(low[:, :hi].view(1, done + rows, w), factor, upsample, tokenizer=tokenizer, net=upsampler)
            b0, b1 = done * factor * W, (done + rows) * factor * W       # the block of high-resolution slots
            x[:, b0:b1] = up.reshape(1, -1)[:, b0:b1].to(x.device)
            # 3. One target pass over the block: output i is the distribution of slot b0 + i. It
            # also writes the tokens the previous cycle resolved in its last resampling pass
            # (`unfed`), so the block's context has no holes.
            if b0 == 0:
                ver = Outputs.cat([first, runner.forward(x[:, :b1 - 1], torch.arange(b1 - 1, device=x.device))])
            else:
                pos = torch.tensor(sorted(set(unfed) | set(range(b0 - 1, b1 - 1))), dtype=torch.long,
                                   device=x.device)
                ver = runner.forward(x[:, pos], pos).select(slice(pos.numel() - (b1 - b0), None))
            # 4.-5. Pooled threshold, local rejection windows inside the block.
            pooled = runner.token_probs(ver, x[:, b0:b1], neighbors, delta if neighbors is not None else None).pooled
            verdict = verify(pooled.view(1, rows * factor, W), rule="threshold", tau=tau, mode="local",
                             radius=radius, backend=backend)
            # The one host read of the cycle's verification pass: kept, to resample, the island
            # labels and their count. The resampling passes' positions, masks and draws follow from
            # them, so those passes read nothing back.
            verdict_host = torch.cat([verdict.accept.view(-1).long(), verdict.resample.view(-1).long(),
                                      verdict.islands.view(-1).long(), verdict.num_islands.view(-1)[:1].long()]).tolist()
            n_block = b1 - b0
            acc_b, res_b = verdict_host[:n_block], verdict_host[n_block:2 * n_block]
            isl_b, num_islands = verdict_host[2 * n_block:3 * n_block], verdict_host[3 * n_block]
            accept = torch.zeros(H * W, dtype=torch.bool)
            accept[b0:b1] = torch.tensor(acc_b, dtype=torch.bool)
            stats.acceptance_maps.append(accept.view(H, W))
            accept_map |= accept
            R = [False] * (H * W)
            R[b0:b1] = [bool(r) for r in res_b]
            islands = [-1] * (H * W)
            islands[b0:b1] = [i + b0 if i >= 0 else i for i in isl_b]
            island_map[b0:b1] = torch.tensor(islands[b0:b1], dtype=torch.int32)
            cycles += 1
            resampled += sum(res_b)
            stats.extra.setdefault("num_islands", []).append(num_islands)
            if any(res_b):
                # 6. Resample R_X with the target.
                rpos = [t for t in range(H * W) if R[t]]
                runner.invalidate(torch.tensor(rpos, dtype=torch.long, device=x.device))
                if resample == "raster":
                    unfed = resample_raster(runner, x, ver, rpos, gen, base=b0)
                else:
                    unfed = resample_islands(runner, x, ver, R, islands, gen, base=b0)
            else:
                unfed = []
        stats.extra.setdefault("cycles", []).append(cycles)
        stats.extra.setdefault("resampled", []).append(resampled)
        stats.extra.setdefault("accept_image", []).append(accept_map.view(H, W))
        stats.extra.setdefault("islands", []).append(island_map.view(H, W))
        stats.extra.setdefault("low_res", []).append(drafts.view(h, w).cpu())
        stats.target_forwards = runner.forwards
        stats.draft_forwards = drunner.forwards
        if compile:
            stats.extra.setdefault("compile_s", []).append(dstep.take_compile_s())
        return x

    return run_batches("mulo", target, classes, seed, one_image_at_a_time(run), batch_size=batch_size,
                       tokenizer=tokenizer, progress=progress,
                       first_index=first_index)
