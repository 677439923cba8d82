"""Slots: the model passes of many images' decodes, made together.

Under continuous batching (`specdec.decoding.continuous`) every image runs the method's own code
for one image, in a fiber, on a `SlotRunner`: a ModelRunner look-alike of one image that owns no
cache. Its passes become requests; a `SharedModel` holds the model's one cache of `slots` rows
(image s of the engine in row s) and answers the requests of every waiting image with one batched
pass:

- `prefill`: the condition is written by a one-image runner and its cache row copied into the
  image's row (`SlotKVCache.load_row`), so that a request joins while the others are half done;
- `forward`: every image's tokens in one pass. In-place passes (no tree mask, written) of any
  widths share one pass: a shorter row is padded by feeding its last token again at its own
  position (which writes the same keys and values at the same slot and sees what that token
  sees: bit for bit the pass it asked for). A block attended with a tree mask or without writing
  reads its own width in every query's softmax, so such passes share a pass only with passes of
  the same width. Rows with nothing to do ride along at the last raster position, whose output
  predicts a position past the grid that nothing reads (and only a query there sees its slot);
- `step`: an AR step of every image in a run of AR steps (`TokenStep.run`), each at its own
  position; the image resumes only when its run is done. When few slots run (light load), the
  steps go over their rows alone, kept in a runner of that many images while the same slots run.

Everything else a method asks of its runner is a function of the outputs it already has
(`probs`, `token_probs`, SSD's head drafts through `function`): the one-image runner computes it,
in the image's fiber. Forgetting slots (`invalidate*`) touches the image's own row only.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch

from specdec import masks
from specdec.decoding.compiled import CompiledRunner, _store_key, runner_for
from specdec.decoding.scheduler import cuda_graphs
from specdec.decoding.runner import ModelRunner, Outputs, TokenStep, count_pass


class Forward(NamedTuple):
    slot: int
    tokens: torch.Tensor                 #: [1, N]
    positions: torch.Tensor              #: [1, N]
    tree_mask: Optional[torch.Tensor]    #: [1, N, words] or None
    write: bool


class Run(NamedTuple):
    """An image's AR steps from `start` to `end` (`TokenStep.run`): answered when all are made."""

    slot: int
    x: torch.Tensor           #: [1, H*W] the image's grid, positions up to `start` drawn; filled in at the end
    start: int
    end: int
    uniforms: torch.Tensor    #: [end - start - 1, 1]


class Prefill(NamedTuple):
    slot: int
    condition: torch.Tensor   #: [1] class id (or its embedding)


def slot_graphs() -> bool:
    """Whether the engine's compiled passes replay CUDA graphs (on CUDA): the scheduler's switch
    (`scheduler.cuda_graphs`, SPECDEC_CONTINUOUS_GRAPHS=1), opt-in until they have run on a GPU."""
    return cuda_graphs()


def _slot_batch_runner(model, sampling, slots: int, backend, compile: bool, store: Optional[dict]) -> ModelRunner:
    """The runner of all slots: eager, or a compiled one kept apart from the lockstep decoders'
    (its AR step takes a position per row, so its graphs differ): in `store` (a streaming
    engine's own), or on the model."""
    if not compile:
        return ModelRunner(model, sampling, batch=slots, backend=backend)
    graphs = slot_graphs()
    key = _store_key(model, sampling, slots, backend) + (graphs, "slots")
    if store is None:
        store = model.__dict__.setdefault("_specdec_slot_runners", {})
    else:
        key = (id(model),) + key
    if key not in store:
        store[key] = CompiledRunner(model, sampling, batch=slots, backend=backend, graphs=graphs)
    store[key].reset()
    return store[key]


class SharedModel:
    """One model's passes for all the slots of a continuous engine."""

    def __init__(self, model, sampling, slots: int, backend, compile: bool, store: Optional[dict] = None):
        """`store`: where the compiled runners are kept (a streaming engine's own; None: on the
        model, `compiled_runner`)."""
        self.slots = slots
        self.batch = _slot_batch_runner(model, sampling, slots, backend, compile, store)
        #: the one-image runner: prefills, and the functions of outputs the images compute
        self.single = runner_for(model, sampling, 1, backend, compile=compile, store=store)
        self.H, self.W = self.batch.H, self.batch.W
        self._step: Optional[TokenStep] = None
        self.prefills = 0
        # The AR runs in progress (`step`): each slot's grid and uniforms kept here, in rows of
        # one tensor each, so that a step for every running image is a few tensor operations
        # whatever their number; `_next[s]`: the position slot s draws next (host int).
        self._grid: Optional[torch.Tensor] = None
        self._uniforms: Optional[torch.Tensor] = None
        self._runs: List[Optional[Run]] = [None] * slots
        self._next: List[int] = [0] * slots
        #: a pass or a forgetting since the last step: the next step counts on paying its copies
        #: again (other images in other phases will likely want other rows before the step after)
        self._disturbed = False

    @property
    def passes(self) -> int:
        """Passes made so far: the batched ones and the one-image prefills."""
        return self.batch.forwards + self.prefills

    def take_compile_s(self) -> float:
        parts = [r for r in (self.batch, self.single) if isinstance(r, CompiledRunner)]
        return sum(r.take_compile_s() for r in parts)

    # ---- the passes ----
    def prefill(self, request: Prefill) -> Outputs:
        self.prefills += 1
        self.single.reset()
        out = self.single.prefill(request.condition)
        self.batch.load_row(self.single.cache, request.slot)
        return out

    def forward(self, requests: List[Forward]) -> Dict[int, Outputs]:
        """As few passes as pay (see the module's docstring): passes in place are split into
        passes by width at the least cost (`_in_place_groups`); blocks join blocks of their width."""
        self._disturbed = True
        in_place = [r for r in requests if r.tree_mask is None and r.write]
        groups = self._in_place_groups(in_place)
        blocks: Dict[tuple, List[Forward]] = {}
        for r in requests:
            if not (r.tree_mask is None and r.write):
                blocks.setdefault((r.tokens.shape[1], r.tree_mask is not None, r.write), []).append(r)
        replies = {}
        for group in groups + list(blocks.values()):
            replies.update(self._pass(group))
        return replies

    def _in_place_groups(self, requests: List[Forward]) -> List[List[Forward]]:
        """Requests in place cut into passes, each as wide as its widest, at the least total
        `pass_cost` (a pass's fixed cost against the padding a wider pass carries). Requests of one
        width always share a pass (splitting them never costs less), so the cuts fall between
        widths: a search over the few distinct widths, widest first, not over every request (it
        runs every engine step)."""
        by_width: Dict[int, List[Forward]] = {}
        for r in requests:
            by_width.setdefault(r.tokens.shape[1], []).append(r)
        widths = sorted(by_width, reverse=True)
        counts = [0]
        for w in widths:
            counts.append(counts[-1] + len(by_width[w]))
        best, cut = [0.0], [0]
        for i in range(1, len(widths) + 1):
            cost, j = min((best[j] + self.pass_cost(counts[i] - counts[j], widths[j]), j) for j in range(i))
            best.append(cost)
            cut.append(j)
        groups, i = [], len(widths)
        while i > 0:
            groups.append([r for w in widths[cut[i]:i] for r in by_width[w]])
            i = cut[i]
        return groups[::-1]

    def pass_cost(self, k: int, width: int) -> float:
        """What a pass of `width` tokens for k of the slots costs (`ModelRunner.pass_cost`)."""
        return self.batch.pass_cost(k, width)

    def _pass(self, group: List[Forward]) -> Dict[int, Outputs]:
        dev = self.batch.device
        N = max(r.tokens.shape[1] for r in group)
        images = self._images([r.slot for r in group], N)
        where = {slot: i for i, slot in enumerate(images)}
        k = len(images)
        # The rows are joined with one `cat` each (not written row by row into a zero tensor: a
        # write per row costs as much host time as the small passes themselves). A shorter row is
        # padded with its last token at its last position; a row riding along feeds token 0 at
        # the last raster position.
        mine = {r.slot: r for r in group}
        idle_tokens = idle_positions = None
        token_rows, position_rows = [], []
        for slot in images:
            r = mine.get(slot)
            if r is None:
                if idle_tokens is None:
                    idle_tokens = torch.zeros(1, N, dtype=torch.long, device=dev)
                    idle_positions = torch.full((1, N), self.H * self.W - 1, dtype=torch.long, device=dev)
                token_rows.append(idle_tokens)
                position_rows.append(idle_positions)
                continue
            n = r.tokens.shape[1]
            token_rows.append(r.tokens if n == N else torch.cat([r.tokens, r.tokens[:, -1:].expand(1, N - n)], 1))
            position_rows.append(r.positions if n == N else
                                 torch.cat([r.positions, r.positions[:, -1:].expand(1, N - n)], 1))
        tokens, positions = torch.cat(token_rows), torch.cat(position_rows)
        mask = None
        if group[0].tree_mask is not None:
            mask = masks.pack(torch.eye(N, dtype=torch.bool, device=dev)).expand(k, -1, -1).clone()
            for r in group:
                mask[where[r.slot]] = r.tree_mask[0]
        if k == self.slots:
            out = self.batch.forward(tokens, positions, tree_mask=mask, write=group[0].write)
        else:   # (a pass over some images: their rows held apart, as for the AR steps)
            count_pass(self.batch, N)
            out = self.batch.hold(images)[0].forward(tokens, positions, tree_mask=mask, write=group[0].write)
        return {r.slot: self._row(out, where[r.slot], r.tokens.shape[1]) for r in group}

    def _images(self, slots: List[int], width: int) -> List[int]:
        """The cache rows a pass of `width` tokens for `slots` runs over: all of them, or those
        images alone (and, compiled, others up to the rounded count) when that costs less."""
        rows = self.batch.rows_to_pass(slots, width)
        return list(range(self.slots)) if rows is None else rows

    @staticmethod
    def _row(out: Outputs, i: int, n: int) -> Outputs:
        """Row i's outputs of a batched pass, as its own one-image pass gives them (views: with CFG
        its hidden rows i and i + B as one strided slice, not a gathered copy)."""
        B = out.cond.shape[0]
        return Outputs(out.cond[i:i + 1, :n], None if out.uncond is None else out.uncond[i:i + 1, :n],
                       out.hidden[i::B, :n], None if out.probs is None else out.probs[i:i + 1, :n])

    def step(self, runs: List[Run]) -> Dict[int, None]:
        """One AR step of every image in `runs`, each at its own position; returns the images
        whose run is complete (their grids filled in). An image's run stays with the engine from
        step to step: the image resumes only when all its steps are made, so a step costs the
        same few tensor operations however many images it serves (no hand-over per token). When
        few slots run, the steps go over their rows alone, kept in a runner of that many images
        while the same slots run (`_step_over`)."""
        C, dev, HW = self.slots, self.batch.device, self.H * self.W
        if self._grid is None:
            self._grid = torch.zeros(C, HW, dtype=torch.long, device=dev)
            self._uniforms = torch.zeros(C, HW, dtype=torch.float32, device=dev)
        for r in runs:
            if self._runs[r.slot] is not r:       # a run that starts: its grid and uniforms in
                self._runs[r.slot] = r
                self._next[r.slot] = r.start + 1
                self._grid[r.slot] = r.x[0]
                self._uniforms[r.slot, r.start + 1:r.end] = r.uniforms[:, 0]
        rows, step, index = self._step_over(runs)
        # Each running image feeds its newest token at its position; the other rows of the step
        # ride along, feeding token 0 at the last raster position (whose output nothing reads).
        fed_at = {r.slot: self._next[r.slot] - 1 for r in runs}
        fed = [fed_at.get(s, HW - 1) for s in rows]
        position = torch.tensor(fed, dtype=torch.long).view(-1, 1).to(dev)
        going = torch.tensor([s in fed_at for s in rows]).view(-1, 1).to(dev)
        drawn = (position + 1).clamp(max=HW - 1)
        grid = self._grid if index is None else self._grid.index_select(0, index)
        uniforms = self._uniforms if index is None else self._uniforms.index_select(0, index)
        tokens = torch.where(going, grid.gather(1, position), 0)
        # The eager step reads the cache up to `reach` when every row it feeds is a running image.
        reach = max(fed) if len(fed_at) == len(rows) else None
        out = step(tokens, position, uniforms.gather(1, drawn)[:, 0], reach=reach)
        # Every row's draw is written, the riding rows' too: theirs lands at the last position,
        # which no run feeds (a run feeds positions before its end) and a run that draws it
        # overwrites; a run starting in a slot copies its whole grid in.
        if index is None:
            self._grid.scatter_(1, drawn, out[:, None])
        else:
            self._grid.index_put_((index, drawn[:, 0]), out)
        done = {}
        for r in runs:
            self._next[r.slot] += 1
            if self._next[r.slot] == r.end:
                r.x[0, r.start + 1:r.end] = self._grid[r.slot, r.start + 1:r.end]
                self._runs[r.slot] = None
                done[r.slot] = None
        return done

    def _step_over(self, runs: List[Run]):
        """(the slots a step goes over, in order; its AR step; their rows as int64 [k], or None
        for all slots). All slots, or (`ModelRunner.rows_to_step`: when that costs less for the
        steps left before the first of these runs ends) the running slots' rows, taken into a
        runner of that many images and kept there (`ModelRunner.hold`) while the same rows step:
        copied in once and back once rather than per step, for a lone request at light load pays
        otherwise what a full engine pays per token."""
        # (the steps the copies are paid for: until the first run ends, or one step when the
        # slots' other passes came between the last two steps and will likely come again)
        steps = 1 if self._disturbed else min(r.end - self._next[r.slot] for r in runs)
        self._disturbed = False
        rows = self.batch.rows_to_step(sorted(r.slot for r in runs), steps)
        if rows is None:
            if self._step is None:
                self._step = self.batch.token_step()
            return range(self.slots), self._step, None
        part, index = self.batch.hold(rows)
        count_pass(self.batch, 1)      # (passes made: counted on the runner of all slots)
        return rows, part.token_step(), index

    # ---- one row's cache ----
    def forget(self, slot: int, positions: torch.Tensor, where: Optional[torch.Tensor]) -> None:
        """Forget image `slot`'s raster `positions` [N] or [1, N] (where `where` [1, N] is set), in
        its row held apart too (`ModelRunner.hold`)."""
        self._disturbed = True
        positions = positions.reshape(1, -1).to(self.batch.device)
        mine = torch.zeros(self.slots, positions.shape[1], dtype=torch.bool, device=positions.device)
        mine[slot] = True if where is None else where.reshape(-1).to(positions.device)
        self.batch.invalidate_where(positions.expand(self.slots, -1), mine)


class SlotRunner:
    """What a method's code for one image sees as its runner under continuous batching: the
    ModelRunner interface of one image, its passes made by `shared` for all slots at once
    (`ask` hands a request to the scheduler and returns its answer)."""

    batch = 1

    def __init__(self, shared: SharedModel, slot: int, ask):
        self.shared, self.slot, self._ask = shared, slot, ask
        single = shared.single
        self.model, self.sampling, self.backend = single.model, single.sampling, single.backend
        self.H, self.W, self.device = single.H, single.W, single.device
        self.forwards = self.fed = self.widest = 0

    def prefill(self, classes) -> Outputs:
        self.forwards += 1
        return self._ask(self.shared, Prefill(self.slot, classes))

    def forward(self, tokens, positions, *, tree_mask=None, write=True) -> Outputs:
        count_pass(self, tokens.shape[1])
        positions = positions.reshape(1, -1).to(self.device)
        if tree_mask is not None and tree_mask.dim() == 2:
            tree_mask = tree_mask[None]
        return self._ask(self.shared, Forward(self.slot, tokens.to(self.device), positions, tree_mask, write))

    def token_step(self) -> "SlotTokenStep":
        return SlotTokenStep(self)

    def invalidate(self, positions: torch.Tensor) -> None:
        if positions.numel():
            self.shared.forget(self.slot, positions, None)

    def invalidate_where(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        if positions.numel():
            self.shared.forget(self.slot, positions, mask)

    # ---- functions of outputs: the one-image runner's ----
    def outputs(self, logits, hidden) -> Outputs:
        return self.shared.single.outputs(logits, hidden)

    def outputs_at(self, logits, hidden, positions) -> Outputs:
        return self.shared.single.outputs_at(logits, hidden, positions)

    def probs(self, o: Outputs) -> torch.Tensor:
        return self.shared.single.probs(o)

    def token_probs(self, o: Outputs, tokens, neighbors=None, delta=None):
        return self.shared.single.token_probs(o, tokens, neighbors, delta)

    def function(self, key, make):
        return self.shared.single.function(key, make)

    def _settings(self):
        return self.shared.single._settings()


class SlotTokenStep:
    """`TokenStep` for one image under continuous batching: its AR steps made with every
    running image's (`SharedModel.step`)."""

    def __init__(self, runner: SlotRunner):
        self.runner = runner

    def run(self, x: torch.Tensor, start: int, end: int, uniforms: torch.Tensor) -> None:
        r, steps = self.runner, end - start - 1
        if steps <= 0:
            return
        count_pass(r, 1, passes=steps)
        r._ask(r.shared, Run(r.slot, x, start, end, uniforms.to(r.device)))

    def take_compile_s(self) -> float:
        return 0.0


__all__ = ["SharedModel", "SlotRunner", "SlotTokenStep"]
