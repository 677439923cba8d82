"""The slot KV cache of the transformers adapters, also a transformers `Cache`.

`HFSlotCache` is a `specdec.models.kv_cache.SlotKVCache` (keys and values written at given slots,
a validity vector, `prefix_len`, `position_slots`) that transformers' attention layers can take
as their cache (`cache_keyword`: `cache=` from transformers 5.25, `past_key_values=` before):
each layer calls `update(key, value, layer_idx)`, and the cache answers
with the keys the `specdec` attention reads, in one of two modes:

- a slot step (what `HFImageModel` runs): before the layers run, `begin_step(slots, ...)` says
  where the new tokens go; `update` writes them there (not appending) when the step writes, and
  returns the whole cache prefix [0, limit) (in-place step: the new keys are found at their
  slots) or that prefix followed by the new block (`write=False` scoring and tree steps, the
  block last as `tree_attention`'s tree_mask expects), as specdec.models.gpt does;
- append (no step begun: a plain `model(..., cache=cache, use_cache=True)`): the new
  tokens go after the last appended one, as in transformers' static cache.

Capacity: the longest prompt plus the grid's slots (plus one row-end slot per row and a scratch
slot with row ends, see RowEndSlotCache). Per-row left padding (`pad`, set by the prefill) gives
the RoPE position of a slot: `slot - pad[row]`.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from specdec.models.kv_cache import SlotKVCache

try:  # transformers is an optional dependency of specdec; the adapters need it
    from transformers.cache_utils import Cache as _HFCache
except ImportError:  # pragma: no cover - exercised only without transformers
    _HFCache = object


def cache_keyword(forward) -> str:
    """The keyword a transformers forward (a model's or a decoder layer's) takes its KV cache by:
    `cache` from transformers 5.25 on, where `past_key_values` is deprecated (a warning on every
    call; removed in 5.40), `past_key_values` before. (The signature of the function itself:
    transformers' decorators keep it as `__wrapped__`.)"""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class HFSlotCache(SlotKVCache, _HFCache):
    """SlotKVCache + the transformers `Cache` interface (`update`, `get_seq_length`,
    `get_mask_sizes`). `n_layers` layers of [rows, n_kv_heads, n_slots, head_dim]."""

    is_compileable = False
    ROW_STATE = SlotKVCache.ROW_STATE + ("pad",)

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, n_slots: int, head_dim: int, *,
                 cfg: bool = False, dtype=torch.float32, device=None, prefix_len: int = 0):
        SlotKVCache.__init__(self, n_layers, batch, n_kv_heads, n_slots, head_dim, cfg=cfg, dtype=dtype,
                             device=device, prefix_len=prefix_len)
        if _HFCache is not object:
            _HFCache.__init__(self, layers=[])
        self.n_layers = n_layers
        #: left padding of each row (RoPE position of slot s in row r is s - pad[r])
        self.pad = torch.zeros(self.rows, dtype=torch.int64, device=self.device)
        self._step = None
        self._appended = 0   # append mode: slots used so far

    # ---- slot steps (HFImageModel) ------------------------------------------------------------
    def begin_step(self, slots: torch.Tensor, *, write: bool, in_place: bool, limit: int) -> None:
        """Route the next `update` calls: the new tokens' slots [rows, N] (int64), whether they
        are written, whether attention reads them from the cache (in_place) or as a block after
        the prefix [0, limit)."""
        self._step = (slots, write, in_place, limit)

    def end_step(self) -> None:
        self._step = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._step is None:
            return self._append(key_states, value_states, layer_idx)
        slots, write, in_place, limit = self._step
        if write:
            self.write(layer_idx, slots, key_states, value_states)
        k, v = self.k[layer_idx][:, :, :limit], self.v[layer_idx][:, :, :limit]
        if in_place:
            return k, v
        return (torch.cat([k, key_states.to(k.dtype)], dim=2), torch.cat([v, value_states.to(v.dtype)], dim=2))

    # ---- append mode (plain transformers calls) -----------------------------------------------
    def _append(self, key_states, value_states, layer_idx):
        n = key_states.shape[2]
        start = self._appended
        if start + n > self.n_slots:
            raise ValueError(f"the cache holds {self.n_slots} slots; appending {n} after {start} overflows it")
        slots = torch.arange(start, start + n, device=self.device).expand(self.rows, n)
        self.write(layer_idx, slots, key_states, value_states)
        if layer_idx == self.n_layers - 1:
            self.valid[:, start:start + n] = True
            self._appended = start + n
        return self.k[layer_idx][:, :, :start + n], self.v[layer_idx][:, :, :start + n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._appended

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self._appended + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._appended

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.n_slots

    def __len__(self) -> int:
        return self.n_layers

    @property
    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        SlotKVCache.reset(self)
        self._appended = 0
        self._step = None

    # ---- position -> slot ---------------------------------------------------------------------
    def slot_limit(self, position: int) -> int:
        """A host-side bound: one past the last slot raster position `position` uses."""
        return self.prefix_len + position + 1

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rows={self.rows}, slots={self.n_slots}, layers={self.n_layers}, "
                f"prefix_len={self.prefix_len})")


class RowEndSlotCache(HFSlotCache):
    """The cache of models that end every grid row with a row-end token (Emu3, Lumina-mGPT):
    raster position u lives in slot `prefix_len + u + u // W`, the row end of row r right after
    its last token. The last slot is scratch (never valid): tokens that carry no row end send
    their unused row-end companion there (see HFImageModel.forward_tokens)."""

    def __init__(self, *args, width: int, **kwargs):
        super().__init__(*args, **kwargs)
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.width = width

    @property
    def scratch_slot(self) -> int:
        return self.n_slots - 1

    def position_slots(self, positions: torch.Tensor) -> torch.Tensor:
        p = positions.to(self.device).long()
        return p + p // self.width + self.prefix_len

    def row_end_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The row-end slot of each position at a row's end, the scratch slot elsewhere."""
        p = positions.to(self.device).long()
        at_end = p % self.width == self.width - 1
        return torch.where(at_end, self.position_slots(p) + 1, torch.full_like(p, self.scratch_slot))

    def slot_limit(self, position: int) -> int:
        # + 1 more: the row end fed with a row's last token
        return self.prefix_len + position + position // self.width + 2

    def invalidate_positions(self, positions: torch.Tensor, where: Optional[torch.Tensor] = None) -> None:
        """As SlotKVCache's, and a position at a row's end takes its row-end slot with it."""
        slots = self.check_slots(self.position_slots(positions), "positions", check_range=False)
        ends = self.check_slots(self.row_end_slots(positions), "positions", check_range=False)
        # the scratch slot is never valid, so its duplicates all write False
        self._forget(torch.cat([slots, ends], dim=1), positions, where)
