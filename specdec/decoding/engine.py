"""The engine: the round state of one batch of a decode, owned in one place.

A method (a policy: `ar`, `sd`, `lantern`, `sjd`, `zipar`, `mulo`, `ssd`) decides what each pass
feeds, how the target judges the drafts (a rule and mode of `verify_grid`) and what it redraws.
Everything else of a round is here, written once (docs/engine.md, "The round: state, policy, one
read": the streams, runners, committed lengths and the read-accept-commit step).

    engine = Engine(run, streams, grid)            # the scheduler makes one for its rows
    target = engine.runner(model)
    ...                                             # the method's passes
    verdict = engine.judge(p_tok, q_tok, uniforms=u, starts=c.host, judged=n_host, mode="raster")
    engine.redraw(x, picks, p_rows, q_rows)
    engine.release()                                # done: compiled runners back to their models
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from specdec import switches
from specdec.decoding.compiled import put_back, runner_for
from specdec.decoding.draws import draw_residual
from specdec.decoding.runner import ModelRunner, Outputs
from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.models.conditions import pad_with_first
from specdec.ops.dispatch import resolve
from specdec.ops.verification import verify_grid_unchecked
from specdec.settings import RunSettings


class Lengths:
    """Per image, how many raster positions are committed: `device` (int64 [B]) for the passes,
    `host` (ints) for the loop, advanced together from the one read of each pass."""

    def __init__(self, values: Sequence[int], device):
        self.host = list(values)
        self.device = to_device(self.host, device, torch.long)

    def advance(self, device_delta: torch.Tensor, host_delta: Sequence[int]) -> None:
        """Add a step computed on the device and the same step as host ints (no read-back)."""
        self.device = self.device + device_delta
        self.host = [c + d for c, d in zip(self.host, host_delta)]

    def move(self, src: int, dst: int, idle: int) -> None:
        """Row `src`'s length to row `dst`; row `src` at `idle` (a row without an image)."""
        self.host[dst], self.host[src] = self.host[src], idle
        self.device = self.device.clone()
        self.device[dst] = self.device[src]
        self.device[src] = idle

    def reset_rows(self, rows: Sequence[int], value: int) -> None:
        """Rows `rows`' lengths set to `value` (rows of the scheduler's batch that start images)."""
        for b in rows:
            self.host[b] = value
        self.device = self.device.index_fill(0, to_device(list(rows), self.device.device, torch.long), value)


@dataclass
class Judgement:
    """The host side of a verdict over each image's window of L drafts (the pass's one read)."""

    accept: List[List[bool]]        #: [B][L] drafts kept
    resample: List[List[bool]]      #: [B][L] positions to draw again
    #: [B][L] island labels of `resample` (-1 outside), when the judge was asked for them
    islands: Optional[List[List[int]]] = None
    num_islands: Optional[List[int]] = None
    #: the verdict itself, on the device (what the passes that commit the drafts compute with)
    verdict: Optional[object] = None

    def kept(self, b: int) -> int:
        """How many of image b's drafts were kept (in raster mode: its kept prefix)."""
        return sum(self.accept[b])


class Verdict(NamedTuple):
    """A verdict on the device, not read yet (`Engine.verdict`)."""

    verdict: object            #: verify_grid's output
    host: torch.Tensor         #: int64 [B, K]: what the read brings back
    width: int                 #: L, the drafts per row
    islands: bool
    starts: List[int]
    judged: List[int]
    rows: Optional[Sequence[int]]


class Engine:
    """One batch of a decode: its images' streams, its runners, its judgements (their statistics go
    to the scheduler's rows)."""

    def __init__(self, run: RunSettings, streams: ImageStreams, grid: Tuple[int, int]):
        self.run = run
        self.streams = streams
        self.batch = len(streams)
        self.H, self.W = grid
        #: the batch's runners so far, each with its role (target, drafter, preview)
        self.runners: List[Tuple[ModelRunner, str]] = []
        #: the scheduler whose rows these are (`specdec.decoding.scheduler.Scheduler`; see `record`)
        self.rows = None
        #: the models' compiled runners this batch holds, out of their stores until `release`
        self.held: dict = {}

    def narrowed(self, width: int) -> int:
        """`width` tokens per pass cut to the share of each image (`RunSettings.token_share`; None:
        no limit). A method narrows its speculation to fit it; at 1 it makes plain AR steps."""
        share = self.run.token_share
        return width if share is None else min(width, share)

    def runner(self, model, sampling=None, *, role: str = "target") -> ModelRunner:
        """The batch's runner of `model` (eager, or with `run.compile` the model's kept compiled
        one), its passes counted as `role`: "target", "drafter", or "preview" (the target model on
        its preview grid: target passes of the preview stage)."""
        if role not in ("target", "drafter", "preview"):
            raise ValueError(f"role must be target, drafter or preview, got {role!r}")
        sampling = sampling or self.run.sampling_or_default
        runner = runner_for(model, sampling, self.batch, self.run.backend, compile=self.run.compile,
                            graphs=cuda_graphs(), held=self.held, role=role)
        resolve(self.run.backend, runner.device)     # (a backend this device lacks: refused before any pass)
        self.runners.append((runner, role))
        return runner

    def prefill_rows(self, runner: ModelRunner, rows: Sequence[int], conditions) -> Tuple[Outputs, torch.Tensor]:
        """Prefill `conditions` (one per row) into rows `rows` (sorted) of `runner`'s cache; returns
        the outputs and each row's distribution of token 0 ([k, V]). The other rows are untouched:
        the first k rows, when no image is in the rows up to the `part_size`, are prefilled in
        place (`prefix`, a view: a lockstep batch's last, smaller group, a stream after idle; the
        runner itself when the part is the whole batch); other rows on a `part`, copied in
        (`SlotKVCache.put_images`). A part's or view's extra rows
        are prefilled with the first condition. Each row's image is counted one pass of the
        runner's role."""
        role = next(rr for r, rr in self.runners if r is runner)
        k = len(rows)
        size = runner.part_size(k) if k < self.batch else k
        in_place = k == self.batch or (list(rows) == list(range(k)) and self.rows is not None
                                       and self.rows.free(range(k, size)))
        if in_place and size == self.batch:
            # (the whole cache: the runner itself, not a second runner and graph on a view of it)
            runner.cache.reset()
            source = runner
        else:
            source = runner.prefix(size) if in_place else runner.part(size)
            source.reset()
            runner.forwards += 1     # (a pass of the batch's runner, made on a view or a part of it)
        out = source.prefill(pad_with_first(conditions, source.batch))
        if not in_place:
            source.cache.prefix(k).put_images(runner.cache, to_device(list(rows), runner.device, torch.long))
        if k < source.batch:
            out = out.first(k)
        if self.rows is not None:
            self.rows.credit(rows, role, 1, 0, 0)
        return out, source.probs(out)[:, 0]

    def release(self) -> None:
        """The batch is done: the compiled runners it held go back to their models for the next
        decode (`compiled.put_back`)."""
        put_back(self.held)

    # ---- the read-accept-commit step ----
    def judge(self, score: torch.Tensor, q: Optional[torch.Tensor] = None, **how) -> Judgement:
        """`verdict` and its host read (`read_verdicts`) at once: a pass judged alone."""
        return self.read_verdicts([self.verdict(score, q, **how)])[0]

    def verdict(self, score: torch.Tensor, q: Optional[torch.Tensor] = None, *, starts: Sequence[int],
                judged: Sequence[int], rule: str = "ratio", uniforms: Optional[torch.Tensor] = None,
                valid: Optional[torch.Tensor] = None, islands: bool = False, rows: Optional[Sequence[int]] = None,
                **how) -> "Verdict":
        """`verify_grid` over each image's drafts, on the device: not read yet (`read_verdicts` reads
        several at once, `judge` one).

        score, q: [B, L] (a raster window; column k of image b is raster position starts[b] + k)
        or [B, H, W] (a whole grid, starts 0); `uniforms` for rule="ratio"; `valid` the columns
        holding a draft (None: all); `judged[b]` how many image b has (the drafted count
        recorded); `how`: the rule's and mode's arguments (mode, tau, radius). `islands=True`
        reads the island labels too (MuLo-SD's resampling schedule). `rows`: the batch's rows that
        score's B rows are (None: all of them, in order)."""
        B = score.shape[0]
        shape = (B, 1, score.shape[-1]) if score.dim() == 2 else tuple(score.shape)
        view = (lambda t: None if t is None else t.reshape(shape))
        verdict = verify_grid_unchecked(score.reshape(shape), view(q), rule, uniforms=view(uniforms),
                                        valid=view(valid), backend=self.run.backend, **how)
        parts = [verdict.accept.view(B, -1), verdict.resample.view(B, -1)]
        if islands:
            parts += [verdict.islands.view(B, -1), verdict.num_islands.view(B, 1)]
        return Verdict(verdict, torch.cat([t.long() for t in parts], 1), parts[0].shape[1], islands, list(starts),
                       list(judged), rows)

    def read_verdicts(self, verdicts: Sequence["Verdict"]) -> List[Judgement]:
        """The host side of `verdicts` in one host read: which drafts were kept and which are
        drawn again (and where the islands are). How many uniforms each image draws next depends
        on it, and so do the next pass's shape and the loop's control."""
        flat = torch.cat([v.host.reshape(-1) for v in verdicts]).tolist()
        out, at = [], 0
        for v in verdicts:
            B, K = v.host.shape
            host = [flat[at + b * K:at + (b + 1) * K] for b in range(B)]
            at += B * K
            L = v.width
            judgement = Judgement([[bool(x) for x in row[:L]] for row in host],
                                  [[bool(x) for x in row[L:2 * L]] for row in host], verdict=v.verdict)
            if v.islands:
                judgement.islands = [row[2 * L:3 * L] for row in host]
                judgement.num_islands = [row[3 * L] for row in host]
            self.record(judgement.accept, v.starts, v.judged, v.rows)
            out.append(judgement)
        return out

    def record(self, accept: List[List[bool]], starts: Sequence[int], judged: Sequence[int],
               rows: Optional[Sequence[int]] = None) -> None:
        """One judgement into the statistics: the map of kept drafts over the grid, and the
        drafted and kept counts (`rows`: which of the batch's rows were judged; None: all), each
        row's part to the image it holds (`Scheduler.record`; rows riding along: none). An engine
        outside a scheduler (the unit tests') keeps no statistics."""
        if self.rows is None:
            return
        HW, B = self.H * self.W, len(accept)
        amap = torch.zeros(B, HW, dtype=torch.bool)
        for b, (row, start) in enumerate(zip(accept, starts)):
            if start < 0:       # (columns before the grid: padding of a row with a shorter window)
                row, start = row[-start:], 0
            inside = row[:max(0, HW - start)]
            if inside:
                amap[b, start:start + len(inside)] = torch.tensor(inside, dtype=torch.bool)
        amap = amap.view(B, self.H, self.W)
        for i, b in enumerate(range(B) if rows is None else rows):
            if judged[i]:
                self.rows.record(b, amap[i:i + 1], int(judged[i]), sum(accept[i]))

    def redraw(self, x: torch.Tensor, picks: Sequence[Tuple[int, int]], p: torch.Tensor,
               q: Optional[torch.Tensor] = None, *, with_distribution: bool = False):
        """Draw a token at each pick (image, raster position; each image's picks in order, the
        images in order) from the residual norm(max(0, p - q)) of its row of p, q [M, V] (p where
        that is zero or q is None: a bonus or resampled token), with image b's uniforms from its
        own stream, and write it into x [B, H*W]. Returns the tokens (and with_distribution: the
        residual distributions too)."""
        if not picks:
            return None
        counts = [0] * self.batch
        for b, _ in picks:
            counts[b] += 1
        if [b for b, _ in picks] != sorted(b for b, _ in picks):
            raise ValueError("redraw's picks must list the images in order")
        out = draw_residual(p, q, self.streams.rand_counts(counts), self.run.backend,
                            with_distribution=with_distribution)
        rows, cols = to_device([[b for b, _ in picks], [t for _, t in picks]], x.device, torch.long)
        x[rows, cols] = out[0] if with_distribution else out
        return out

def cuda_graphs() -> bool:
    """Whether the scheduler's compiled passes replay CUDA graphs on CUDA: opt-in by the switch
    SPECDEC_CONTINUOUS_GRAPHS=1 until they have run on a GPU (`specdec.switches`)."""
    return switches.value("SPECDEC_CONTINUOUS_GRAPHS") == "1"


__all__ = ["Engine", "Judgement", "Lengths", "cuda_graphs"]
