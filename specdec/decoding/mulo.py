"""`mulo`: MuLo-SD, multi-scale local speculative decoding (docs/decoders.md, "mulo"), lossy by design.

1. Draft: a same-family drafter on the low-resolution grid (H/r x W/r) samples the whole
   low-resolution image, serially (`drafting="serial"`, v1) or row-staggered (`drafting="zipar"`,
   v2's drafter).
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

On a model that writes its own low-resolution preview first (GLM-Image: `family.preview`),
`draft="preview"` makes that preview the draft: the preview stage (the target model itself on the
preview grid) samples it, the target stage is conditioned on it (`target.condition_on_preview`),
and it is up-sampled to the target grid (token-space `nearest` for any ratio, `learned` for an
integer one) and verified as above. No drafter model: the preview passes are the target model's
own and count as target passes; the preview grids come back as `DecodeResult.preview`.

Grids need not be square, nor divide: a drafter or preview grid (h, w) of a target (H, W) with
h <= H, w <= W is up-sampled by `nearest` or `pixel` whatever the ratio; `learned` needs
H = r h and W = r w.

Target passes per image: prefill + one verification + the resampling passes. (Drafting the image
in several cycles, each continuing from the down-sampled accepted rows, cost more passes and lost
on FD on the embedded family; it is gone: docs/experiments.md.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from specdec import masks
from specdec.decoding import upsample as _up
from specdec.decoding.ar import sample_grid
from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.compiled import record_compile_s, runner_for
from specdec.decoding.draws import verify
from specdec.decoding.lantern import check_delta, check_k, neighbor_table
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.decoding.zipar import check_window, zipar_grid
from specdec.ops.verification import sample_residual_unchecked
from specdec.settings import RunSettings, Sampling, check_int

DRAFTING = ("serial", "zipar")
RESAMPLING = ("islands", "raster")
#: where the low-resolution draft comes from: a drafter model, or the target's own preview stage
DRAFTS = ("drafter", "preview")


def check_tau(tau) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"tau must be a finite number >= 0 (tau > 1 rejects every draft), got {tau!r}")
    return float(tau)


@dataclass(frozen=True)
class MuloOptions:
    tau: float = 0.05            #: accept a draft iff its pooled target probability >= tau
    radius: int = 1              #: local rejection windows of (2 radius + 1)^2 around each rejection
    k: int = 1000                #: neighbours per token in the pooling table (capped at V - 1)
    delta: float = 0.4           #: the moved mass's budget (MuLo-SD's reading of LANTERN's rule)
    #: the high-resolution draft: "learned" (the family's trained up-sampler), "pixel" (VQ decode,
    #: resize, encode: the paper's pipeline with bicubic in place of its super-resolution net) or
    #: "nearest" (each low-resolution token repeated r x r; a baseline)
    upsample: str = "learned"
    drafting: str = "serial"     #: the low-resolution draft: "serial" (v1) or "zipar" (v2)
    window: int = 2              #: drafting="zipar": the row stagger of the drafter
    resample: str = "islands"    #: "islands" (v2, concurrent) or "raster" (v1)
    draft_sampling: Optional[Sampling] = None   #: the drafter's sampling (None: the run's)
    #: "drafter": a low-resolution drafter model of the same codebook (drafter=...); "preview": the
    #: target's own preview stage (GLM-Image; the family's `preview`), so no drafter model
    draft: str = "drafter"

    def __post_init__(self):
        check_tau(self.tau)
        check_int(self.radius, "radius")
        check_k(self.k)
        check_delta(self.delta)
        if self.upsample not in _up.MODES:
            raise ValueError(f"upsample must be one of {', '.join(_up.MODES)}, got {self.upsample!r}")
        if self.drafting not in DRAFTING:
            raise ValueError(f"drafting must be one of {', '.join(DRAFTING)}, got {self.drafting!r}")
        check_int(self.window, "window", 1)
        if self.resample not in RESAMPLING:
            raise ValueError(f"resample must be one of {', '.join(RESAMPLING)}, got {self.resample!r}")
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if self.draft_sampling is not None and not isinstance(self.draft_sampling, Sampling):
            raise ValueError(f"draft_sampling must be a Sampling or None, got {type(self.draft_sampling).__name__}")


def check_models(target, drafter, upsample: str = "nearest"):
    """The drafter's fit for the target: same vocabulary, a grid no larger per side; returns the
    integer factor r (H = r h, W = r w) or None when the grids do not divide, which only the
    `nearest` and `pixel` up-samplers take."""
    check_grid_model(target, "target")
    check_grid_model(drafter, "drafter")
    (H, W), (h, w) = tuple(target.grid), tuple(drafter.grid)
    if h > H or w > W:
        raise ValueError(f"drafter grid {(h, w)} is larger than the target grid {(H, W)} on a side")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} differs from the target's {target.vocab_size}: "
                         "MuLo-SD needs one shared codebook")
    factor = H // h if H % h == 0 and W % w == 0 and H // h == W // w else None
    if factor is None and upsample == "learned":
        raise ValueError(f"drafter grid {(h, w)} does not divide the target grid {(H, W)} by one factor r per side: "
                         "the learned up-sampler needs one (upsample='nearest' or 'pixel' take any ratio)")
    return factor


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
    tok = sample_residual_unchecked(probs, None, to_device(u, probs.device), runner.backend).tokens.long()
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
    output predicts a position past the block, which nothing reads."""
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


def _check_resources(target, drafter, tokenizer, upsampler, options: MuloOptions):
    """The models' fit for these options (a ValueError naming what is missing); returns r (None:
    the grids do not divide)."""
    if drafter is None:
        if options.draft == "preview":
            raise ValueError("mulo with draft='preview' needs the target's preview stage (drafter=family.preview); "
                             "this model writes no preview")
        raise ValueError("mulo needs a low-resolution drafter (drafter=...), or draft='preview' on a model that "
                         "writes its own preview (GLM-Image)")
    if options.draft == "preview" and not callable(getattr(target, "condition_on_preview", None)):
        raise ValueError("draft='preview' needs a target conditioned on its own preview (condition_on_preview: "
                         "a two-stage model such as GLM-Image)")
    factor = check_models(target, drafter, options.upsample)
    if options.drafting == "zipar":
        check_window(options.window, drafter.grid[1])
    if options.upsample == "pixel" and tokenizer is None:
        raise ValueError("upsample='pixel' needs the VQ tokenizer (tokenizer=...); a model without a pixel decoder "
                         "takes upsample='nearest' or 'learned'")
    if options.upsample == "learned":
        if upsampler is None:
            raise ValueError("upsample='learned' needs the trained up-sampler (upsampler=...)")
        if upsampler.codebook.shape[0] != target.vocab_size or upsampler.factor != factor:
            raise ValueError(f"the learned up-sampler maps {upsampler.codebook.shape[0]} codes by factor "
                             f"{upsampler.factor}; this target has {target.vocab_size} codes and factor {factor}")
    return factor


def decode(target, conditions, *, drafter, tokenizer=None, upsampler=None, codebook=None, neighbors=None,
           options: MuloOptions = MuloOptions(), run: RunSettings = RunSettings()):
    """MuLo-SD on `target` with the low-resolution `drafter` (same codebook, a grid no larger per
    side; with `options.draft="preview"` the target's own preview stage); `upsampler` for
    upsample="learned", the VQ `tokenizer` for "pixel", the pooling neighbours from `neighbors`
    [V, K] or built from `codebook` [V, D].

    The images of a batch share their passes (`_resample`: islands differ per image, so a
    resampling step may take more than one pass); each image draws from its own stream. With
    `run.compile` every target and drafter pass runs through compiled graphs padded to bucket
    widths (specdec.decoding.compiled), the drafter's serial steps through the compiled AR step
    `ar` runs, and both prefills when the models allow it; the up-sampler stays eager."""
    _check_resources(target, drafter, tokenizer, upsampler, options)
    o = options
    if neighbors is None and codebook is not None and o.k > 0:
        neighbors = neighbor_table(codebook, o.k)
    delta = o.delta if neighbors is not None else None
    sampling = run.sampling_or_default
    draft_sampling = o.draft_sampling or sampling
    h, w = drafter.grid
    preview = o.draft == "preview"

    def decode_batch(cls, gen, stats):
        B = cls.shape[0]
        drunner = runner_for(drafter, draft_sampling, B, run.backend, compile=run.compile)
        runner = runner_for(target, sampling, B, run.backend, compile=run.compile)
        H, W = runner.H, runner.W
        HW = H * W
        # 1. Draft the low-resolution image (with draft="preview": the target's own preview).
        if o.drafting == "serial":
            low = torch.zeros(B, h * w, dtype=torch.long, device=drunner.device)
            sample_grid(drunner, cls, gen, start_out=drunner.prefill(cls), x=low, step=drunner.token_step())
        else:
            low = zipar_grid(drunner, cls, gen, window=o.window)
        grids = low.view(B, h, w)
        first = runner.prefill(target.condition_on_preview(cls, grids) if preview else cls)
        # 2. Up-sample, image by image (batch-independent).
        up = torch.cat([_up.upsample(grids[b:b + 1], (H, W), o.upsample, tokenizer=tokenizer, net=upsampler)
                        for b in range(B)])
        x = to_device(up.reshape(B, HW), runner.device).long().contiguous()
        # 3. One target pass over the draft: output i is the distribution of slot i.
        ver = Outputs.cat([first, runner.forward(x[:, :HW - 1], torch.arange(HW - 1, device=x.device))])
        # 4.-5. Pooled threshold, local rejection windows.
        pooled = runner.token_probs(ver, x, neighbors, delta).pooled
        verdict = verify(pooled.view(B, H, W), rule="threshold", tau=o.tau, mode="local", radius=o.radius,
                         backend=run.backend)
        # The one host read of the verification pass: kept, to resample, the island labels and
        # their count, per image. The resampling passes' positions, masks and draws follow from
        # them, so those passes read nothing back.
        verdict_host = torch.cat([verdict.accept.view(B, -1).long(), verdict.resample.view(B, -1).long(),
                                  verdict.islands.view(B, -1).long(),
                                  verdict.num_islands.view(B, -1)[:, :1].long()], 1).tolist()
        R_all, islands_all, rpos_all = [], [], []
        accept_maps, island_maps, resampled, num_islands = [], [], [], []
        for vh in verdict_host:
            accept, R = vh[:HW], [bool(r) for r in vh[HW:2 * HW]]
            islands, n_isl = vh[2 * HW:3 * HW], vh[3 * HW]
            accept_maps.append(torch.tensor(accept, dtype=torch.bool).view(H, W))
            island_maps.append(torch.tensor(islands, dtype=torch.int32).view(H, W))
            resampled.append(sum(R))
            num_islands.append(n_isl)
            R_all.append(R if any(R) else None)
            islands_all.append(islands)
            rpos_all.append([t for t in range(HW) if R[t]])
        if any(R is not None for R in R_all):
            # 6. Resample R_X with the target.
            rmask = torch.tensor([R if R is not None else [False] * HW for R in R_all], dtype=torch.bool,
                                 device=x.device)
            runner.invalidate_where(torch.arange(HW, device=x.device).expand(B, -1), rmask)
            if o.resample == "raster":
                resample_raster(runner, x, ver, rpos_all, gen)
            else:
                resample_islands(runner, x, ver, R_all, islands_all, gen)
        stats.acceptance_maps.extend(accept_maps)
        stats.extra.setdefault("num_islands", []).extend(num_islands)
        stats.extra.setdefault("resampled", []).extend(resampled)
        stats.extra.setdefault("accept_image", []).extend(accept_maps)
        stats.extra.setdefault("islands", []).extend(island_maps)
        stats.extra.setdefault("low_res", []).extend(grids.cpu().unbind(0))
        # A shared pass counts once per image, as for the other batched methods.
        stats.target_forwards = runner.forwards * B
        stats.target_tokens_fed = runner.fed * B
        stats.draft_forwards = drunner.forwards * B
        if preview:
            # The preview is the target model's own output: its passes are target passes, its
            # tokens committed tokens, its grids part of the result (DecodeResult.preview).
            stats.target_forwards += stats.draft_forwards
            stats.draft_forwards = 0
            stats.tokens += B * h * w
            stats.extra.setdefault("preview_forwards", []).extend([drunner.forwards] * B)
            stats.extra.setdefault("preview", []).extend(grids.cpu().unbind(0))
        if run.compile:
            record_compile_s(stats, runner, drunner)
        return x

    return run_batches("mulo", target, conditions, decode_batch, run, tokenizer)


OPTIONS = MuloOptions
#: The published reading where the family default differs: the paper up-samples in pixel space
#: (its super-resolution network replaced by bicubic interpolation here).
PRESETS = {"published": MuloOptions(upsample="pixel")}
