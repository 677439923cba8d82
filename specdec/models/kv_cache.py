"""A KV cache indexed by slot (prefix slots, then raster token slots) with a validity vector.

Slots are not appended: a forward writes the keys/values of its tokens at their slots, so a
decoder can fill the grid out of order (ZipAR rows, MuLo-SD islands), invalidate slots it
rejected and overwrite them later (local resampling). Attention reads only valid slots at
positions <= the query's (the `tree_attention` rule), so stale entries are harmless once
invalidated. With classifier-free guidance the cache holds 2B rows, image b's conditional row
2b and its unconditional row 2b + 1 (`specdec.models.protocol.cfg_rows`): the first k images are
the cache's first rows, so a pass over them runs on a view (`prefix`), copying nothing.

The cache also owns the map from raster positions to slots (`position_slots`): raster token u
lives in slot `prefix_len + u`. `prefix_len` is the model's for class-conditional models and is
set by the prefill for prompts of varying length (the longest prompt of the batch; shorter ones
are left-padded with invalid slots). A model whose sequence interleaves other tokens with the
raster tokens (Emu3's row ends) subclasses the cache and overrides `position_slots` and
`invalidate_positions`.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from specdec.models.protocol import cfg_rows, image_rows, move_rows


class SlotKVCache:
    #: the attributes holding one entry per row besides the keys and values (a subclass adds its
    #: own, e.g. each row's left padding): what moves with a row, what a view slices, what `reset`
    #: and `clone` cover
    ROW_STATE = ("valid",)

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, n_slots: int, head_dim: int, *,
                 cfg: bool = False, dtype=torch.float32, device=None, prefix_len: int = 0):
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch = batch
        self.cfg = cfg
        self.rows = 2 * batch if cfg else batch
        self.n_slots = n_slots
        self.prefix_len = prefix_len   #: slots before raster token 0 (see position_slots)
        shape = (self.rows, n_kv_heads, n_slots, head_dim)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.valid = torch.zeros(self.rows, n_slots, dtype=torch.bool, device=device)
        self._row_index = torch.arange(self.rows, device=device)[:, None]   # write()'s row index, made once
        # Key positions are the slot indices themselves (raster order = causal order).
        self.kv_pos = torch.arange(n_slots, dtype=torch.int32, device=device).expand(self.rows, n_slots)

    @property
    def device(self) -> torch.device:
        return self.valid.device

    def check_slots(self, slots: torch.Tensor, name: str = "slots", check_range: bool = True) -> torch.Tensor:
        """slots [N] or [rows, N] (or [batch, N] with CFG, duplicated) -> int64 [rows, N], range-checked."""
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {slots.dtype}")
        if slots.dim() == 1:
            slots = slots.expand(self.rows, -1)
        elif slots.dim() == 2 and self.cfg and slots.shape[0] == self.batch and self.rows != self.batch:
            slots = cfg_rows(slots)
        if slots.dim() != 2 or slots.shape[0] != self.rows:
            raise ValueError(f"{name} must be [N] or [{self.batch}, N]" +
                             (f" or [{self.rows}, N]" if self.cfg else "") + f", got {tuple(slots.shape)}")
        if check_range and slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.n_slots):
            raise ValueError(f"{name} must lie in [0, {self.n_slots}), got [{int(slots.min())}, {int(slots.max())}]")
        return slots.to(device=self.device, dtype=torch.int64)

    def check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, N] (duplicated for the CFG rows) or [rows, N], int -> [rows, N]."""
        if tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() != 2:
            raise ValueError(f"tokens must be a 2-D int tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        if tokens.shape[0] == self.batch and self.cfg:
            tokens = cfg_rows(tokens)
        if tokens.shape[0] != self.rows:
            raise ValueError(f"tokens has {tokens.shape[0]} rows, the cache {self.batch}" +
                             (f" (or {self.rows})" if self.cfg else ""))
        return tokens

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [rows, Hkv, N, D] at slots [rows, N] (overwrites what was there).

        An indexed store (`index_put_`) rather than `scatter_` with an expanded index: both write
        the same elements, but torch.compile lowered the scatter into loops over the whole cache
        (rows x heads x slots x D, several times per layer), which made a compiled AR step at
        batch 16 twice as slow as the eager one; the indexed store touches the new slots only."""
        if slots.shape[0] == self.rows:
            rows = self._row_index
        else:
            rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        # cache[rows, :, slots] is [rows, N, Hkv, D] (the advanced indices' dimensions first)
        self.k[layer][rows, :, slots] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, slots] = v.transpose(1, 2).to(self.v[layer].dtype)

    def set_valid(self, slots: torch.Tensor, value: bool = True) -> None:
        slots = self.check_slots(slots)
        self.valid.scatter_(1, slots, value)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Mark slots [N] or [batch, N] as empty: later queries no longer see them."""
        self.set_valid(slots, False)

    def position_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The slots of raster positions (any shape, int) -> int64 of the same shape."""
        return positions.to(self.device).long() + self.prefix_len

    def invalidate_positions(self, positions: torch.Tensor, where: Optional[torch.Tensor] = None) -> None:
        """Forget raster positions [N] or [batch, N]; with `where` (bool, the shape of positions
        [batch, N]) only the set entries, a different count per image, with no host read (positions
        distinct within a row)."""
        self._forget(self.check_slots(self.position_slots(positions), "positions", check_range=False), positions, where)

    def _forget(self, slots: torch.Tensor, positions: torch.Tensor, where: Optional[torch.Tensor]) -> None:
        """Invalidate slots [rows, k * N], k slots per entry of positions [.., N] (a model may keep
        more than one slot per position), all or only where `where` [batch, N] is set."""
        if where is None:
            self.valid.scatter_(1, slots, False)
            return
        if where.shape != positions.shape or positions.dim() != 2:
            raise ValueError(f"where must be bool [batch, N] like positions, got {tuple(where.shape)}")
        keep = ~where.to(self.device)
        if keep.shape[0] != self.rows:
            keep = cfg_rows(keep, self.rows // keep.shape[0])
        keep = torch.cat([keep] * (slots.shape[1] // keep.shape[1]), dim=1)
        self.valid.scatter_(1, slots, self.valid.gather(1, slots) & keep)

    def reset(self) -> None:
        """Every row empty: every slot invalid, the row state zeroed."""
        for t in self.row_state():
            t.zero_()

    def row_state(self) -> List[torch.Tensor]:
        """The tensors of `ROW_STATE`."""
        return [getattr(self, name) for name in self.ROW_STATE]

    def image_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The rows of images `index` (int64 [k]), in cache order (with CFG each image's two)."""
        return image_rows(index.to(self.device).long(), 2 if self.cfg else 1)

    def move_image(self, src: int, dst: int) -> None:
        """Image `src`'s rows (keys, values, row state) copied onto image `dst`'s."""
        move_rows(self.batch, src, dst, *self.k, *self.v, *self.row_state())

    def prefix(self, k: int) -> "SlotKVCache":
        """The cache of its first k images, a view: the same tensors' first rows (what a pass
        writes there is written here), for passes over those images alone."""
        if not 1 <= k <= self.batch:
            raise ValueError(f"k must lie in [1, {self.batch}], got {k}")
        rows = k * self.rows // self.batch
        return self._copy(lambda t: t[:rows], batch=k, rows=rows, kv_pos=self.kv_pos[:rows],
                          _row_index=self._row_index[:rows])

    def take_images(self, source: "SlotKVCache", index: torch.Tensor) -> None:
        """Make this cache of k images a copy of images `index` (int64 [k]) of `source`: keys,
        values and valid slots, the CFG rows too, copied into this cache's own tensors (their
        addresses kept: a compiled pass over this cache runs over some images of `source`, and
        `put_images` copies what it wrote back)."""
        rows = source.image_rows(index)
        for mine, theirs in zip(self.k + self.v + self.row_state(), source.k + source.v + source.row_state()):
            torch.index_select(theirs, 0, rows, out=mine)
        if source.prefix_len != self.prefix_len:
            self.prefix_len = source.prefix_len

    def put_images(self, target: "SlotKVCache", index: torch.Tensor) -> None:
        """Copy this cache of k images into images `index` of `target` (`take_images`' inverse)."""
        if target.prefix_len != self.prefix_len:
            raise ValueError(f"rows of one cache share their prefix length: these hold {self.prefix_len} slots "
                             f"before raster token 0, the cache they join {target.prefix_len}")
        rows = target.image_rows(index)
        for mine, theirs in zip(self.k + self.v + self.row_state(), target.k + target.v + target.row_state()):
            theirs.index_copy_(0, rows, mine)

    def clone(self) -> "SlotKVCache":
        return self._copy(torch.clone)

    def _copy(self, per_row, **fields) -> "SlotKVCache":
        """A cache of the same kind whose keys, values and row state are `per_row` of this one's
        (a view of some rows, a clone), the other attributes shared or set by `fields`."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.k = [per_row(t) for t in self.k]
        other.v = [per_row(t) for t in self.v]
        for name in self.ROW_STATE:
            setattr(other, name, per_row(getattr(self, name)))
        other.__dict__.update(fields)
        return other
