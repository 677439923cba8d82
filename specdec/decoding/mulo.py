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

Target passes per image: prefill + one verification + the resampling passes. A batch's images
share their passes; each image draws from its own stream. The method's own figures per image
(islands, resampled positions, the low-resolution drafts) are `MuloStats`, in
`DecodeStats.method_stats`; the acceptance maps are the engine's (one [B, H, W] map per batch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from specdec import masks
from specdec.decoding import upsample as _up
from specdec.decoding.ar import plain_ar, sample_grid
from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.engine import Engine, Judgement
from specdec.decoding.lantern import check_delta, check_k, neighbor_table
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.uploads import to_device
from specdec.decoding.zipar import check_window, zipar_grid
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
    factor = _up.target_grid((h, w), (H, W))[1]
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


@dataclass
class MuloStats:
    """MuLo-SD's own figures, one entry per image (`DecodeStats.method_stats`)."""

    num_islands: List[int]              #: islands of R_X
    resampled: List[int]                #: positions of R_X (resampled by the target)
    islands: List[torch.Tensor]         #: int32 [H, W] island labels (-1 outside R_X)
    low_res: List[torch.Tensor]         #: int64 [h, w] low-resolution drafts


def _gathered(o: Outputs, rows: list, cols: list) -> Outputs:
    """Outputs [1, n, V] at the (row, column) pairs (host ints) of a batched pass."""
    rr, cc = to_device([rows, cols], o.cond.device, torch.long)
    return o.map(lambda t: t[rr, cc][None])


def _draw_at(engine: Engine, runner: ModelRunner, x, o: Outputs, picks: list) -> None:
    """picks: (image, output column, raster position) host triples, the images in order;
    x[image, position] = a token drawn from that output, image b's uniforms from its stream."""
    if picks:
        probs = runner.probs(_gathered(o, [b for b, _, _ in picks], [c for _, c, _ in picks]))[0]
        engine.redraw(x, [(b, t) for b, _, t in picks], probs)


def _resample_pass(engine: Engine, runner: ModelRunner, x, work: dict, *, tree: bool, end: int) -> None:
    """One shared resampling pass: work[b] = (positions to resolve now, the block of slots fed,
    which of them are resolved) for the images in it (the others ride along at slot end - 1);
    `tree`: the blocks hold another island's unresolved token, so a tree mask hides it."""
    B, dev = x.shape[0], x.device
    N = max(len(block) for _, block, _ in work.values())
    pos = to_device([work[b][1] + [end - 1] * (N - len(work[b][1])) if b in work else [end - 1] * N
                     for b in range(B)], dev, torch.long)
    mask = None
    if tree:
        # A query slot of another island's unresolved token: visible to its own query only
        # (and rows riding along see themselves only).
        dense = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
        for b, (_, _, trusted) in work.items():
            dense[b] |= torch.tensor(trusted, dtype=torch.bool)[None, :]
        mask = masks.pack(to_device(dense, dev))
    out = runner.forward(x.gather(1, pos), pos, tree_mask=mask)
    if mask is not None:
        stale = torch.zeros(B, N, dtype=torch.bool)
        for b, (_, _, trusted) in work.items():
            stale[b, :len(trusted)] = torch.tensor([not ok for ok in trusted])
        runner.invalidate_where(pos, to_device(stale, dev))
    _draw_at(engine, runner, x, out, [(b, block.index(u - 1), u) for b, (now, block, _) in work.items() for u in now])


def _resample(engine: Engine, runner: ModelRunner, x, ver: Outputs, plans: list, *, base: int, end: int) -> list:
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
    _draw_at(engine, runner, x, ver, [(b, plan[0] - base, plan[0]) for b, plan in enumerate(plans) if plan])
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
            _resample_pass(engine, runner, x, {b: work[b] for b in groups[key]}, tree=key is not None, end=end)
            for b in groups[key]:
                for u in work[b][0]:
                    plans[b][2][u] = True
                last[b] = work[b][0]
    return last


def resample_raster(engine: Engine, runner: ModelRunner, x: torch.Tensor, ver: Outputs, rpos: list, base: int = 0,
                    end: Optional[int] = None) -> list:
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
    return _resample(engine, runner, x, ver, plans, base=base, end=HW if end is None else end)


def resample_islands(engine: Engine, runner: ModelRunner, x: torch.Tensor, ver: Outputs, resample: list,
                     islands: list, base: int = 0, end: Optional[int] = None, most: Optional[int] = None) -> list:
    """v2: every island of R_X advances one token per pass, all islands in one pass. resample[b]
    (bools; None: nothing to resample) and islands[b] (labels) cover image b's grid, on the
    host: the passes' positions, masks and draw counts follow from them alone, so the passes read
    nothing back. The first token of the first island (the first rejection) is drawn from the
    verification outputs `ver` (positions base, base + 1, ...): its context is all accepted.
    Returns the positions each image resolved in its last pass (host lists), whose keys and values
    are not written yet. `most`: at most this many islands advance in one pass (a step of more is
    split into passes of `most`, islands in label order; None: all at once)."""
    HW = x.shape[1]
    plans = []
    for R, isl in zip(resample, islands):
        if R is None or True not in R:
            plans.append(None)
            continue
        t0 = R.index(True)                       # the first rejection: R_X starts there
        sched = island_schedule(R, isl)
        steps = [now for now in [[u for u in sched[0] if u != t0]] + sched[1:] if now]
        if most is not None:
            steps = [now[i:i + most] for now in steps for i in range(0, len(now), most)]
        resolved = [not r for r in R]
        resolved[t0] = True
        plans.append((t0, steps, resolved))
    return _resample(engine, runner, x, ver, plans, base=base, end=HW if end is None else end)


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


class MuloPolicy:
    """MuLo-SD over a batch's engine: draft low, up-sample, verify once, resample R_X. One per
    decode call (its models and options); `decode_batch` is what `run_batches` runs."""

    def __init__(self, target, drafter, *, tokenizer=None, upsampler=None, neighbors=None,
                 options: MuloOptions = MuloOptions()):
        self.target, self.drafter, self.tokenizer, self.upsampler = target, drafter, tokenizer, upsampler
        self.neighbors, self.o = neighbors, options
        self.delta = options.delta if neighbors is not None else None
        self.preview = options.draft == "preview"

    def decode_batch(self, cls, engine: Engine) -> torch.Tensor:
        # The preview is the target model's own output: its passes are target passes (role
        # "preview"), its tokens committed tokens, its grids the result's `preview`.
        drunner = engine.runner(self.drafter, self.o.draft_sampling, role="preview" if self.preview else "drafter")
        runner = engine.runner(self.target)
        H, W = engine.H, engine.W
        # A share of one token per pass leaves nothing to verify a draft with: plain AR, drafting
        # nothing (a two-stage model still writes the preview its target stage is conditioned on).
        plain = engine.token_share == 1
        grids = self.draft(engine, drunner, cls) if self.preview or not plain else None
        first = runner.prefill(self.target.condition_on_preview(cls, grids) if self.preview else cls)
        if plain:
            B = cls.shape[0]
            low = [torch.zeros(0, dtype=torch.long)] * B if grids is None else list(grids.cpu().unbind(0))
            none = [torch.full((H, W), -1, dtype=torch.int32)] * B     # no islands
            engine.stats.method_stats = MuloStats([0] * B, [0] * B, none, low)
            return plain_ar(engine, runner, cls, first)
        x = self.upsample(grids, runner)
        ver, judgement = self.verify(engine, runner, first, x)
        self.resample(engine, runner, x, ver, judgement)
        engine.stats.method_stats = MuloStats(
            num_islands=list(judgement.num_islands), resampled=[sum(R) for R in judgement.resample],
            islands=[torch.tensor(isl, dtype=torch.int32).view(H, W) for isl in judgement.islands],
            low_res=list(grids.cpu().unbind(0)))
        return x

    def draft(self, engine: Engine, drunner: ModelRunner, cls) -> torch.Tensor:
        """1. The low-resolution image [B, h, w] (draft="preview": the target's own preview)."""
        B, (h, w) = cls.shape[0], self.drafter.grid
        if self.o.drafting == "serial":
            low = torch.zeros(B, h * w, dtype=torch.long, device=drunner.device)
            sample_grid(drunner, cls, engine.streams, start_out=drunner.prefill(cls), x=low, step=drunner.token_step())
        else:
            low = zipar_grid(drunner, cls, engine.streams, window=self.o.window)
        grids = low.view(B, h, w)
        if self.preview:
            engine.previews = grids
            engine.stats.tokens += B * h * w
        return grids

    def upsample(self, grids: torch.Tensor, runner: ModelRunner) -> torch.Tensor:
        """2. The high-resolution draft x~ [B, H*W], up-sampled image by image (batch-independent)."""
        B, H, W = grids.shape[0], runner.H, runner.W
        up = torch.cat([_up.upsample(grids[b:b + 1], (H, W), self.o.upsample, tokenizer=self.tokenizer,
                                     net=self.upsampler) for b in range(B)])
        return to_device(up.reshape(B, H * W), runner.device).long().contiguous()

    def verify(self, engine: Engine, runner: ModelRunner, first: Outputs, x: torch.Tensor):
        """3.-5. One target pass over the draft (output i: the distribution of slot i), the pooled
        threshold and the local rejection windows -> (the verification outputs, the judgement:
        the pass's one host read, islands included)."""
        B, HW = x.shape
        # Under a token budget the pass is cut into causal chunks of the image's share (the same
        # outputs, more passes), as an engine chunks a long prefill.
        step = engine.narrowed(HW - 1)
        fed, positions = x[:, :HW - 1], torch.arange(HW - 1, device=x.device)
        ver = Outputs.cat([first] + [runner.forward(fed[:, a:a + step], positions[a:a + step])
                                     for a in range(0, HW - 1, step)])
        pooled = runner.token_probs(ver, x, self.neighbors, self.delta).pooled
        judgement = engine.judge(pooled.view(B, runner.H, runner.W), rule="threshold", tau=self.o.tau, mode="local",
                                 radius=self.o.radius, islands=True, starts=[0] * B, judged=[HW] * B)
        return ver, judgement

    def resample(self, engine: Engine, runner: ModelRunner, x: torch.Tensor, ver: Outputs, judgement: Judgement):
        """6. R_X resampled with the target, its slots' keys and values dropped first. The passes'
        positions, masks and draws follow from the judgement's host read: they read nothing back."""
        R_all = [R if True in R else None for R in judgement.resample]
        if all(R is None for R in R_all):
            return
        B, HW = x.shape
        rmask = torch.tensor(judgement.resample, dtype=torch.bool, device=x.device)
        runner.invalidate_where(torch.arange(HW, device=x.device).expand(B, -1), rmask)
        if self.o.resample == "raster":
            rpos = [[t for t, r in enumerate(R) if r] for R in judgement.resample]
            resample_raster(engine, runner, x, ver, rpos)
        else:
            # A pass feeds up to two tokens per island it advances: under a token budget, fewer
            # islands at a time.
            share = engine.token_share
            resample_islands(engine, runner, x, ver, R_all, judgement.islands,
                             most=None if share is None else max(1, share // 2))


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
    if neighbors is None and codebook is not None and options.k > 0:
        neighbors = neighbor_table(codebook, options.k)
    policy = MuloPolicy(target, drafter, tokenizer=tokenizer, upsampler=upsampler, neighbors=neighbors,
                        options=options)
    return run_batches("mulo", target, conditions, policy.decode_batch, run, tokenizer)


OPTIONS = MuloOptions
#: The published reading where the family default differs: the paper up-samples in pixel space
#: (its super-resolution network replaced by bicubic interpolation here).
PRESETS = {"published": MuloOptions(upsample="pixel")}

#: The models MuLo-SD takes besides its target (keyword arguments of `decode`).
TAKES = ("drafter", "upsampler", "codebook", "neighbors")


def resources(family, given: dict, options: MuloOptions) -> dict:
    """The models of `TAKES`: those given, else the family's: its low-resolution drafter (its
    preview stage with draft="preview"), its codebook, its up-sampler for upsample="learned"."""
    res = {name: given.get(name) for name in TAKES}
    if res["drafter"] is None:
        res["drafter"] = family.preview if options.draft == "preview" else family.drafter
    if res["neighbors"] is None and res["codebook"] is None:
        res["codebook"] = family.codebook
    if options.upsample == "learned" and res["upsampler"] is None:
        res["upsampler"] = family.upsampler
    return res


def family_defaults(family, given: dict, options: dict, preset: Optional[str]) -> None:
    """The option defaults that depend on the family, set in `options` (the caller's) unless
    chosen there, in the family's own options or by a preset: on a family with a preview stage
    and no drafter model, the preview is the draft (draft="preview"); without a trained
    up-sampler that fits the grids the draft is up-sampled in pixel space through the family's VQ
    (the paper's pipeline), or by token-space nearest when the family has no pixel decoder."""
    own = dict((family.options or {}).get("mulo", {}))
    chosen = {**own, **options}
    if "draft" not in chosen and given.get("drafter") is None and family.drafter is None and family.preview is not None:
        options["draft"] = "preview"
    if preset is not None or "upsample" in chosen:
        return
    net = given.get("upsampler", family.upsampler)
    if net is not None and options.get("draft", own.get("draft")) == "preview":
        # A family's up-sampler serves the preview/target sizes whose ratio is its factor; at
        # other sizes (GLM-Image 19x13 -> 36x24) the preview is up-sampled token by token.
        factor = _up.target_grid(tuple(family.preview.grid), tuple(family.target.grid))[1]
        if factor is None or factor != getattr(net, "factor", None):
            net = None
    if net is None:
        options["upsample"] = "pixel" if given.get("tokenizer", family.tokenizer) is not None else "nearest"


def decodes_preview(options: MuloOptions) -> bool:
    """Whether MuLo-SD decodes a family's preview stage itself (draft="preview": the preview is
    its draft), so that a two-stage decode is one call of `decode`."""
    return options.draft == "preview"
