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
from specdec.decoding.compiled import check_compile, compiled_token_step, runner_for, record_compile_s
from specdec.decoding import kernels
from specdec.decoding.common import (ImageStreams, ModelRunner, Outputs, Sampling, check_grid_model, op_backend,
                                     run_batches, to_device, verify)
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


def _gathered(o: Outputs, rows: list, cols: list) -> Outputs:
    """Outputs [1, n, V] at the (row, column) pairs (host ints) of a batched pass."""
    rr, cc = to_device([rows, cols], o.cond.device, torch.long)
    return o.map(lambda t: t[rr, cc][None])


def _draw_at(runner: ModelRunner, x, o: Outputs, picks: list, gen) -> None:
    """picks: (image, output column, raster position) host triples, each image's in its own
    order; x[image, position] = a token drawn from that output, image b's uniforms from its stream."""
    if not picks:
        return
    B = x.shape[0]
    probs = runner.probs(_gathered(o, [b for b, _, _ in picks], [c for _, c, _ in picks]))[0]
    counts = [0] * B
    for b, _, _ in picks:
        counts[b] += 1
    if isinstance(gen, ImageStreams):
        u = gen.rand_counts(counts)
    else:
        u = torch.rand((len(picks),), generator=gen, dtype=torch.float32)
    tok = kernels.sample_residual(probs, None, to_device(u, probs.device), op_backend("sample_residual", runner.backend,
                                                                          probs.device)).tokens.long()
    dev = x.device
    x[tuple(to_device([[b for b, _, _ in picks], [t for _, _, t in picks]], dev, torch.long))] = tok


def _resample(runner: ModelRunner, x, ver: Outputs, plans: list, gen, *, base: int, end: int) -> list:
    """Resample R_X of every image of the batch in shared passes. plans[b]: None (nothing to
    resample) or (t0, steps, resolved): image b's first position (drawn from the verification
    outputs `ver`, of positions base, base + 1, ...), the positions each later pass resolves, and
    its resolved flags over the grid (host). Returns each image's positions resolved last (keys
    unwritten).

    Pass m of image b feeds its last resolved tokens and the tokens just before the positions it
    resolves now. A pass needs one width for all rows and one attention path: rows whose block
    is all resolved take the in-place path (attention over the cache alone, whatever the width),
    rows with another island's unresolved token need a tree mask, whose attention also reads the
    block, so those share a pass only with rows of the same block width (a wider block would
    change the length of that reduction, and so the logits' last bit). A row not in a pass rides
    along at slot end - 1 (the block's last slot): only a query at that position sees it, whose
    output predicts a position past the block, and the next cycle's verification pass (or
    nothing, after the last cycle) writes it before anything reads it."""
    B = x.shape[0]
    dev = x.device
    _draw_at(runner, x, ver, [(b, plan[0] - base, plan[0]) for b, plan in enumerate(plans) if plan], gen)
    last = [[plan[0]] if plan else [] for plan in plans]
    depth = max((len(plan[1]) for plan in plans if plan), default=0)
    for m in range(depth):
        work = {}
        for b, plan in enumerate(plans):
            if plan and m < len(plan[1]):
                now = plan[1][m]
                block = sorted(set(last[b]) | {u - 1 for u in now})
                work[b] = (now, block, [plan[2][t] for t in block])
        groups = {}
        for b, (_, block, trusted) in work.items():
            groups.setdefault(None if all(trusted) else len(block), []).append(b)
        for key in sorted(groups, key=lambda k: -1 if k is None else k):
            members = groups[key]
            N = max(len(work[b][1]) for b in members)
            pos_host = [work[b][1] + [end - 1] * (N - len(work[b][1])) if b in members else [end - 1] * N
                        for b in range(B)]
            pos = to_device(pos_host, dev, torch.long)
            tree = None
            if key is not None:
                # A query slot of another island's unresolved token: visible to its own query only
                # (and rows riding along see themselves only).
                dense = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
                for b in members:
                    seen = torch.tensor(work[b][2], dtype=torch.bool)
                    dense[b] |= seen[None, :]
                tree = masks.pack(to_device(dense, dev))
            out = runner.forward(x.gather(1, pos), pos, tree_mask=tree)
            if tree is not None:
                stale = torch.zeros(B, N, dtype=torch.bool)
                for b in members:
                    stale[b, :len(work[b][2])] = torch.tensor([not ok for ok in work[b][2]])
                runner.invalidate_where(pos, to_device(stale, dev))
            picks = [(b, work[b][1].index(u - 1), u) for b in members for u in work[b][0]]
            _draw_at(runner, x, out, picks, gen)
            for b in members:
                now = work[b][0]
                for u in now:
                    plans[b][2][u] = True
                last[b] = now
    return last


def resample_raster(runner: ModelRunner, x: torch.Tensor, ver: Outputs, rpos: list, gen, base: int = 0,
                    end: int | None = None) -> list:
    """v1: R_X positions of each image (rpos[b], sorted host ints; empty: nothing to resample)
    one per pass; each pass feeds the token resolved last and the token just before the next
    position (re-encoding a kept token with the corrected context). `ver` holds the verification
    outputs of positions base, base + 1, ...; `end`: the end of the block (default the grid).
    Returns the positions each image resolved last (host lists), whose keys and values are not
    written yet. The schedule is known from R_X alone, so the passes read nothing back."""
    HW = x.shape[1]
    plans = []
    for r in rpos:
        if not r:
            plans.append(None)
            continue
        resolved = [True] * HW
        for t in r:
            resolved[t] = False
        resolved[r[0]] = True
        plans.append((r[0], [[u] for u in r[1:]], resolved))
    return _resample(runner, x, ver, plans, gen, base=base, end=HW if end is None else end)


def resample_islands(runner: ModelRunner, x: torch.Tensor, ver: Outputs, resample: list, islands: list,
                     gen, base: int = 0, end: int | None = None) -> list:
    """v2: every island of R_X advances one token per pass, all islands in one pass. resample[b]
    (bools; None: nothing to resample) and islands[b] (labels) cover image b's grid, on the
    host: the passes' positions, masks and draw counts follow from them alone, so the passes read
    nothing back. The first token of the first island (the first rejection) is drawn from the
    verification outputs `ver` (positions base, base + 1, ...): its context is all accepted.
    Returns the positions each image resolved in its last pass (host lists), whose keys and values
    are not written yet."""
    HW = x.shape[1]
    plans = []
    for R, isl in zip(resample, islands):
        if R is None or True not in R:
            plans.append(None)
            continue
        t0 = R.index(True)                       # the first rejection: R_X starts there
        sched = island_schedule(R, isl)
        steps = [now for now in [[u for u in sched[0] if u != t0]] + sched[1:] if now]
        resolved = [not r for r in R]
        resolved[t0] = True
        plans.append((t0, steps, resolved))
    return _resample(runner, x, ver, plans, gen, base=base, end=HW if end is None else end)


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
    The images of a batch share their passes (`_resample`: islands differ per image, so a
    resampling step may take more than one pass); each image draws from its own stream.
    `compile=True` runs the drafter's serial AR steps through the compiled token step compiled
    `ar` runs, and every target pass (verification, resampling) and the drafter's prefix passes
    through compiled graphs padded to bucket widths (specdec.decoding.compiled), and both
    prefills when the models allow it; the VQ round trip and the up-sampler stay eager."""
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
        raise ValueError("compile=True needs drafting='serial' (the zipar drafter's passes have no compiled form)")

    def run(cls, gen, stats):
        B = cls.shape[0]
        if compile:
            drunner, dstep = compiled_token_step(drafter, draft_sampling, B, backend)
        else:
            drunner, dstep = ModelRunner(drafter, draft_sampling, batch=B, backend=backend), None
        runner = runner_for(target, sampling, B, backend, compile=compile)
        H, W = runner.H, runner.W
        x = torch.zeros(B, H * W, dtype=torch.long, device=runner.device)
        low = torch.zeros(B, h * w, dtype=torch.long, device=drunner.device)  # the drafter's view of the images
        drafts = low.clone()                                                  # what it drafted, for the maps
        accept_map = torch.zeros(B, H * W, dtype=torch.bool)
        island_map = torch.full((B, H * W), -1, dtype=torch.int32)
        maps = [[] for _ in range(B)]                                         # per image: per cycle
        num_islands = [[] for _ in range(B)]
        first = runner.prefill(cls)
        dstart = drunner.prefill(cls) if drafting == "serial" else None   # zipar_grid prefills itself
        cycles = 0
        resampled = [0] * B
        unfed = [[] for _ in range(B)]  # resolved by the last pass, keys unwritten (host ints)
        for done in range(0, h, cycle_rows):                 # low-resolution rows committed so far
            rows = min(cycle_rows, h - done)
            lo, hi = done * w, (done + rows) * w
            if done:
                # 7. The drafter continues from the down-sampled accepted images (one prefix pass;
                # the VQ round trip image by image, so an image's prefix does not depend on its batch).
                prefix = torch.cat([_up.downsample(x[b:b + 1].view(1, H, W)[:, :done * factor].cpu(), factor,
                                                   tokenizer=tokenizer, pad_to=H) for b in range(B)])
                low[:, :lo] = to_device(prefix.reshape(B, lo), low.device)
                dstart = drunner.forward(low[:, :lo], torch.arange(lo, device=low.device)).select(slice(-1, None))
            if drafting == "serial":
                sample_grid(drunner, cls, gen, start_out=dstart, x=low, start=lo, end=hi, step=dstep)
            else:
                low.copy_(zipar_grid(drunner, cls, gen, window=window))
            drafts[:, lo:hi] = low[:, lo:hi]
            # 2. Up-sample (row-causal for `learned`: rows above the block come out as they would
            # have; the block's rows are what is drafted), image by image (batch-independent).
            up = torch.cat([_up.upsample(low[b:b + 1, :hi].view(1, done + rows, w), factor, upsample,
                                         tokenizer=tokenizer, net=upsampler) for b in range(B)])
            b0, b1 = done * factor * W, (done + rows) * factor * W       # the block of high-resolution slots
            x[:, b0:b1] = to_device(up.reshape(B, -1)[:, b0:b1], x.device)
            # 3. One target pass over the block: output i is the distribution of slot b0 + i. It
            # also writes the tokens the previous cycle resolved in its last resampling pass
            # (`unfed`, per image), so the block's context has no holes. Rows with fewer unfed
            # tokens are padded at the front with the block's last fed slot again (the same token
            # at the same slot: nothing else changes).
            if b0 == 0:
                ver = Outputs.cat([first, runner.forward(x[:, :b1 - 1], torch.arange(b1 - 1, device=x.device))])
            else:
                fed = [sorted(set(u) | set(range(b0 - 1, b1 - 1))) for u in unfed]
                N = max(map(len, fed))
                pos = to_device([[b1 - 2] * (N - len(f)) + f for f in fed], x.device, torch.long)
                ver = runner.forward(x.gather(1, pos), pos).select(slice(N - (b1 - b0), None))
            # 4.-5. Pooled threshold, local rejection windows inside the block.
            pooled = runner.token_probs(ver, x[:, b0:b1], neighbors, delta if neighbors is not None else None).pooled
            verdict = verify(pooled.view(B, rows * factor, W), rule="threshold", tau=tau, mode="local",
                             radius=radius, backend=backend)
            # The one host read of the cycle's verification pass: kept, to resample, the island
            # labels and their count, per image. The resampling passes' positions, masks and draws
            # follow from them, so those passes read nothing back.
            n_block = b1 - b0
            verdict_host = torch.cat([verdict.accept.view(B, -1).long(), verdict.resample.view(B, -1).long(),
                                      verdict.islands.view(B, -1).long(),
                                      verdict.num_islands.view(B, -1)[:, :1].long()], 1).tolist()
            R_all, islands_all, rpos_all = [], [], []
            for b, vh in enumerate(verdict_host):
                acc_b, res_b = vh[:n_block], vh[n_block:2 * n_block]
                isl_b, n_isl = vh[2 * n_block:3 * n_block], vh[3 * n_block]
                accept = torch.zeros(H * W, dtype=torch.bool)
                accept[b0:b1] = torch.tensor(acc_b, dtype=torch.bool)
                maps[b].append(accept.view(H, W))
                accept_map[b] |= accept
                R = [False] * (H * W)
                R[b0:b1] = [bool(r) for r in res_b]
                islands = [-1] * (H * W)
                islands[b0:b1] = [i + b0 if i >= 0 else i for i in isl_b]
                island_map[b, b0:b1] = torch.tensor(islands[b0:b1], dtype=torch.int32)
                resampled[b] += sum(res_b)
                num_islands[b].append(n_isl)
                R_all.append(R if any(res_b) else None)
                islands_all.append(islands)
                rpos_all.append([t for t in range(H * W) if R[t]] if any(res_b) else [])
            cycles += 1
            if any(R is not None for R in R_all):
                # 6. Resample R_X with the target.
                rmask = torch.tensor([R[b0:b1] if R is not None else [False] * n_block for R in R_all],
                                     dtype=torch.bool, device=x.device)
                runner.invalidate_where(torch.arange(b0, b1, device=x.device).expand(B, -1), rmask)
                if resample == "raster":
                    unfed = resample_raster(runner, x, ver, rpos_all, gen, base=b0, end=b1)
                else:
                    unfed = resample_islands(runner, x, ver, R_all, islands_all, gen, base=b0, end=b1)
            else:
                unfed = [[] for _ in range(B)]
        for b in range(B):
            stats.acceptance_maps.extend(maps[b])
            stats.extra.setdefault("num_islands", []).extend(num_islands[b])
        stats.extra.setdefault("cycles", []).extend([cycles] * B)
        stats.extra.setdefault("resampled", []).extend(resampled)
        stats.extra.setdefault("accept_image", []).extend(accept_map.view(B, H, W).unbind(0))
        stats.extra.setdefault("islands", []).extend(island_map.view(B, H, W).unbind(0))
        stats.extra.setdefault("low_res", []).extend(drafts.view(B, h, w).cpu().unbind(0))
        # A shared pass counts once per image, as for the other batched methods.
        stats.target_forwards = runner.forwards * B
        stats.draft_forwards = drunner.forwards * B
        if compile:
            record_compile_s(stats, runner, drunner)
        return x

    return run_batches("mulo", target, classes, seed, run, batch_size=batch_size,
                       tokenizer=tokenizer, progress=progress,
                       first_index=first_index)
