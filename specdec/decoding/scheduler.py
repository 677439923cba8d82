"""The scheduler: one loop, `admit -> step -> retire`, over one persistent batch of rows.

A method is a policy over the batch's rows (`RowPolicy`): it starts rows on their images (`start`:
prefills, token 0, per-row state), makes one step over every row (`step`: each op once over the
rows that need it, one pass per model) and says which rows are done. The scheduler owns the rest:
the request queue, which row holds which image, each image's random stream (restarted when a row
takes it) and counters, and when rows take new images.

    scheduler = Scheduler("sd", make_policy, run, grid, capacity=16)
    scheduler.submit(condition, index)
    while not scheduler.idle:
        for image in scheduler.step():       # Finished(index, tokens [H, W], stats, preview)
            ...
    scheduler.engine.release()               # (its compiled runners back to their models)

How each call fills the rows, randomness, counters and which rows a pass covers: docs/engine.md,
"The scheduler: one loop over rows".
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from specdec.decoding.blocks import power_of_two
from specdec.decoding.compiled import CompiledRunner
from specdec.decoding.engine import Engine, cuda_graphs
from specdec.decoding.policy import RowPolicy
from specdec.decoding.results import DecodeStats
from specdec.decoding.streams import ImageStreams
from specdec.models.conditions import Prompts, is_prompts
from specdec.settings import INDICES, RunSettings


class Request(NamedTuple):
    """A queued image: its condition, and the stream it draws from."""

    condition: object              #: one class id (a 0-d tensor) or a `Prompts` of one prompt
    index: int                     #: its image index
    seed: Optional[int] = None     #: its seed (None: the run's)
    tag: Hashable = None           #: the caller's name for it (`cancel`; None: its index)


@dataclass
class Partial:
    """An image still forming (`Scheduler.partials`): its tokens so far and which are final."""

    index: int                     #: its image index
    tag: Hashable                  #: the tag it was submitted with (its index by default)
    tokens: torch.Tensor           #: int64 [H, W] on the CPU: final where raster position < `final`
    final: int                     #: how many raster positions are final (a prefix of raster order)
    draft: Optional[Tuple[torch.Tensor, int]] = None   #: (int64 [h, w], final) a draft at another resolution


@dataclass
class Finished:
    """An image the engine has finished."""

    index: int                        #: its image index (the stream it drew from)
    tokens: torch.Tensor              #: int64 [H, W], on the CPU
    stats: DecodeStats                #: its own statistics (one image)
    preview: Optional[torch.Tensor]   #: int64 [h, w]: the preview grid a method decoded itself, or None
    image: Optional[torch.Tensor] = None   #: [C, h, w] pixels, when the engine has a tokenizer
    tag: Hashable = None              #: the tag it was submitted with (its index by default)


class RowCounts:
    """One live image: its request and its counters: the passes it took part in by role (prefills
    included), the image tokens they fed its row and the widest feed, and its judgements
    (acceptance maps, drafted and kept counts). Which rows took part in a step's passes:
    `Scheduler.credit`."""

    __slots__ = ("request", "passes", "fed", "widest", "maps", "drafted", "accepted")

    def __init__(self, request: Request):
        self.request = request
        self.passes = {"target": 0, "drafter": 0, "preview": 0}
        self.fed = 0
        self.widest = 0
        self.maps: List[torch.Tensor] = []
        self.drafted: List[int] = []
        self.accepted: List[int] = []

    def add(self, role: str, passes: int, fed: int, widest: int) -> None:
        self.passes[role] += passes
        if role != "drafter":
            self.fed += fed
            self.widest = max(self.widest, widest)

    def result(self, method: str, tokens: int, method_stats=None) -> DecodeStats:
        """Its statistics (`tokens` committed: its grid's, and a preview grid it decoded)."""
        own = self.passes
        return DecodeStats(method, images=1, tokens=tokens, target_passes=[own["target"] + own["preview"]],
                           tokens_fed=[self.fed], widest_feed=[self.widest], draft_passes=[own["drafter"]],
                           preview_passes=[own["preview"]] if own["preview"] else [], acceptance_maps=self.maps,
                           drafted=self.drafted, accepted=self.accepted, method_stats=method_stats)


class Scheduler:
    """The persistent batch of `capacity` rows and its loop (docs/engine.md, "The scheduler: one loop
    over rows")."""

    def __init__(self, method: str, make_policy: Callable[[Engine], RowPolicy], run: RunSettings,
                 grid: Tuple[int, int], capacity: int, *, refill: bool = True):
        """`make_policy(engine) -> RowPolicy`: the method's policy over the engine's rows; `refill`:
        a free row takes the next request at once (False: only once every row is free, lockstep
        batches)."""
        self.method, self.grid, self.refill = method, tuple(grid), refill
        streams = ImageStreams(run.seed, [-1 - b for b in range(capacity)], exact=run.exact)
        self.engine = Engine(run, streams, grid)
        self.engine.rows = self
        try:
            self.policy = make_policy(self.engine)
        except BaseException:       # (the runners it took go back to their models)
            self.engine.release()
            raise
        self.queue: Deque[Request] = deque()
        self.rows: List[Optional[RowCounts]] = [None] * capacity   #: the image each row holds
        # `_tick`: each runner's counts at the last tick (a step's passes are the differences), and
        # the rows the policy credited this step (`credit`).
        self._seen: Dict[int, Tuple[int, int]] = {}
        self._credited: Dict[str, List[Tuple[List[int], int, int, int]]] = {}

    @property
    def capacity(self) -> int:
        return len(self.rows)

    @property
    def running(self) -> int:
        """Images decoding now."""
        return sum(r is not None for r in self.rows)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        return not self.queue and not self.running

    def submit(self, condition, index: int, seed: Optional[int] = None, tag: Hashable = None) -> None:
        """Queue a request: `condition` one class id (a 0-d tensor) or a `Prompts` of one prompt,
        drawing from the stream of image `index` of `seed` (None: the run's); `tag`: what `cancel`
        knows it by (None: its index)."""
        if not 0 <= index < INDICES:     # (first_index + an image's place, past the streams there are)
            raise ValueError(f"image index {index} is outside [0, 2**32): first_index plus the images after it must "
                             "stay below 2**32")
        self.queue.append(Request(condition, index, seed, index if tag is None else tag))

    def cancel(self, tag: Hashable) -> int:
        """Withdraw the images submitted with `tag` (by default an image's index; a client gone):
        out of the queue, or their rows freed at once for the next requests, their work stopped
        (`_free`). Returns how many were withdrawn."""
        queued = len(self.queue)
        kept = [r for r in self.queue if r.tag != tag]
        self.queue.clear()
        self.queue.extend(kept)
        running = [b for b, r in enumerate(self.rows) if r is not None and r.request.tag == tag]
        self._free(running)
        if running:
            self._compact()
            self._cover()
        return queued - len(kept) + len(running)

    def partials(self) -> List[Partial]:
        """The images decoding now, as far as they have formed (one host read for all of them), for
        clients that want partial images: each one's tokens, how many of them (a raster prefix) are
        final, and a draft at another resolution where the method makes one (MuLo-SD)."""
        rows = [b for b in range(self.capacity) if self.rows[b] is not None]
        if not rows:
            return []
        H, W = self.grid
        index = torch.tensor(rows, device=self.policy.tokens.device)
        drafts = [self.policy.draft(b) for b in rows]
        # (the grids and the drafts brought back in one copy)
        shown = [self.policy.tokens.index_select(0, index)] + [d[0] for d in drafts if d is not None]
        host = iter(torch.cat([t.reshape(-1) for t in shown]).cpu().split([t.numel() for t in shown]))
        grids = next(host).view(len(rows), H, W)
        out = []
        for b, grid, draft in zip(rows, grids, drafts):
            if draft is not None:
                draft = (next(host).view(draft[0].shape), draft[1])
            request = self.rows[b].request
            out.append(Partial(request.index, request.tag, grid, self.policy.final(b), draft))
        return out

    def drop(self) -> None:
        """Abandon the images decoding: their rows are free (a later request restarts them)."""
        self._free([b for b in range(self.capacity) if self.rows[b] is not None])
        self._cover()

    def _free(self, rows: List[int]) -> None:
        """Rows `rows` hold no image from now on, and the policy stops their work (`RowPolicy.move`
        of a row onto itself): a withdrawn image would otherwise go on through its phases beside
        the others, its passes wasted and its phase changes (a MuLo-SD prefill) made for no image."""
        for b in rows:
            self.rows[b] = None
            self.policy.move(b, b)

    # ---- the loop ----
    def step(self) -> List[Finished]:
        """admit -> step -> retire: free rows take queued requests, one step of the policy over
        every row, and the images it completed leave (returned, in row order)."""
        self._admit()
        if any(r is not None and not d for r, d in zip(self.rows, self.policy.done())):
            self.policy.step()
            self._tick()
        return self._retire()

    def _admit(self) -> None:
        free = [b for b in range(self.capacity) if self.rows[b] is None]
        if not self.queue or not free or (not self.refill and len(free) < self.capacity):
            return
        rows = free[:len(self.queue)]
        conditions = []
        for b in rows:
            request = self.queue.popleft()
            self.engine.streams.restart(b, request.index, request.seed)
            self.rows[b] = RowCounts(request)
            conditions.append(request.condition)
        self.policy.start(rows, join_conditions(conditions))
        self._tick()     # (the prefills, credited to their rows by prefill_rows)
        self._cover()

    def _retire(self) -> List[Finished]:
        done = []
        H, W = self.grid
        for b, complete in enumerate(self.policy.done()):
            if complete and self.rows[b] is not None:
                # (a copy: the row's grid is the next image's once the row is refilled)
                tokens = self.policy.tokens[b].view(H, W).to("cpu", copy=True)
                preview = self.policy.preview(b)
                stats = self.rows[b].result(self.method, H * W + (0 if preview is None else preview.numel()),
                                            self.policy.method_stats(b))
                request = self.rows[b].request
                done.append(Finished(request.index, tokens, stats, preview, tag=request.tag))
                self.rows[b] = None
        if done:
            self._compact()
            self._cover()
        return done

    def _compact(self) -> None:
        """Keep the busy rows the first ones, so that passes go over as few rows as they can
        (`covered_images`): once no request will take a free row at the next step, each busy row at
        or past the bucket of the busy count moves into a free row below it. Only where passes cover
        some rows (a CPU); elsewhere every row is passed anyway."""
        if self.refill and self.queue:
            return
        if any(r.device.type != "cpu" for r, _ in self.engine.runners):
            return
        busy = [b for b in range(self.capacity) if self.rows[b] is not None]
        if not busy:
            return
        k = power_of_two(len(busy))
        if k >= self.capacity:      # (every row is passed anyway)
            return
        free = [b for b in range(k) if self.rows[b] is None]
        for src, dst in zip([b for b in busy if b >= k], free):
            for runner, _ in self.engine.runners:
                runner.cache.move_image(src, dst)
            self.engine.streams.move(src, dst)
            self.policy.move(src, dst)
            self.rows[dst], self.rows[src] = self.rows[src], None

    def _cover(self) -> None:
        """Tell every runner which rows its passes go over now (`covered_images`)."""
        held = [b for b in range(self.capacity) if self.rows[b] is not None]
        for runner, _ in self.engine.runners:
            runner.cover(covered_images(held, self.capacity, runner.device))

    # ---- the counters ----
    def credit(self, rows: List[int], role: str, passes: int, fed: int, widest: int) -> None:
        """Rows `rows` took part in `passes` passes of `role` this step, feeding `fed` image tokens
        each, at most `widest` at once: a policy whose rows are in different phases says which
        rows took which passes (for a role it names in a step, only what it names is counted).
        Prefills (`Engine.prefill_rows`) and SSD's head drafts (`HeadsDrafter`) credit their rows
        so: a policy that prefills rows inside a step credits that step's other target passes too."""
        self._credited.setdefault(role, []).append((list(rows), passes, fed, widest))

    def _tick(self) -> None:
        """Credit the runners' passes since the last tick to the rows that took part (`credit`;
        by default every row holding an image)."""
        e = self.engine
        made: Dict[str, List[int]] = {}
        for runner, role in e.runners:
            forwards, fed = self._seen.get(id(runner), (0, 0))
            self._seen[id(runner)] = (runner.forwards, runner.fed)
            m = made.setdefault(role, [0, 0, 0])
            m[0] += runner.forwards - forwards
            m[1] += runner.fed - fed
            m[2] = max(m[2], runner.widest)
            runner.widest = 0      # (the widest feed since this tick: one number per runner)
        credited, self._credited = self._credited, {}
        held = [b for b in range(self.capacity) if self.rows[b] is not None]
        for role in sorted(set(made) | set(credited)):
            passes, fed, widest = made.get(role, (0, 0, 0))
            for rows, p, f, w in credited.get(role, [(held, passes, fed, widest)]):
                for b in rows:
                    if self.rows[b] is not None:
                        self.rows[b].add(role, p, f, w)

    def free(self, rows) -> bool:
        """Whether none of `rows` holds an image."""
        return all(self.rows[b] is None for b in rows)

    def record(self, b: int, accepted: torch.Tensor, drafted: int, kept: int) -> None:
        """Row b's part of a judgement (its map [1, H, W] of kept drafts, its counts)."""
        r = self.rows[b]
        if r is not None:
            r.maps.append(accepted)
            r.drafted.append(drafted)
            r.accepted.append(kept)

    @property
    def passes_made(self) -> int:
        """Target passes made so far (the prefills included), a pass shared by rows once."""
        e = self.engine
        return sum(r.forwards for r, role in e.runners if role != "drafter")

    def take_compile_s(self) -> float:
        return sum(r.take_compile_s() for r, _ in self.engine.runners if isinstance(r, CompiledRunner))


def covered_images(held: List[int], capacity: int, device: torch.device) -> Optional[int]:
    """How many of the first rows a step's passes go over while rows `held` (sorted) hold images:
    up to the last of them, rounded up to a power of two (None: every row). On the CPU a pass costs
    about its tokens, so a lone request in a batch of 16 would otherwise pay for 16; on a GPU, where
    this has not run yet, every row is passed."""
    if not held or device.type != "cpu":
        return None
    k = power_of_two(held[-1] + 1)
    return None if k >= capacity else k


def join_conditions(conditions: list):
    """Requests' conditions as one batch: class ids [k], or one `Prompts` of k prompts."""
    if is_prompts(conditions[0]):
        negative = [n for c in conditions for n in (c.negative or [None])]
        return Prompts([p for c in conditions for p in c.cond], None if all(n is None for n in negative) else negative)
    return torch.stack([torch.as_tensor(c).reshape(()) for c in conditions]).long()


__all__ = ["Finished", "Partial", "Request", "RowCounts", "Scheduler", "covered_images", "cuda_graphs",
           "join_conditions"]
