"""`HFImageModel`: the ARImageModel protocol over a transformers decoder (docs/hf.md).

A subclass adapts one architecture; the base owns the slot cache, the prefill of text prompts of
different lengths, the multi-token forwards (holes, tree masks, `write=False`, the unchecked fast
path) and the optional row-end tokens. Every language-model layer runs transformers' own code;
its attention goes through `specdec.ops.tree_attention` via `attn_implementation="specdec"`
(specdec.integrations.transformers), which the base switches the language model to.

Subclass hooks (override in an adapter; the first four are required):

- `language_model` (property): the transformers decoder stack (a `LlamaModel`-like module with
  `layers`, `rotary_emb`, `norm`, `config`, `get_input_embeddings()`).
- `embed_image(tokens)`: image-codebook ids [...] (int64, in [0, vocab_size)) -> input
  embeddings [..., hidden_dim] (Janus: generation embeddings + aligner; Emu3: the text embedding
  of the id's text-vocabulary token).
- `image_logits(normed)`: final-normed hidden states [rows, N, hidden_dim] -> float32 logits
  [rows, N, vocab_size] over the image codebook only.
- `unconditional_prompt(ids)`: a conditional prompt (1-D int64 token ids) -> the model's own
  unconditional (CFG) prompt, 1-D int64 (needed only with guidance and no negative prompt).
- `tokenize(text)`: a string -> 1-D int64 prompt ids (default: `processor(text=...)`).
- `embed_text(ids)`: text-vocabulary ids -> input embeddings (default: the language model's
  input embedding); used for prompts and row-end tokens.
- `position_ids(cache, slots)`: the RoPE positions of slots [rows, n] (default `slot - pad[row]`,
  the token's index among its row's real tokens; GLM-Image: M-RoPE (t, h, w) [3, rows, n]).
- `decoder_layers()`, `rotary_embeddings(h, position_ids)`, `final_norm(h)`,
  `run_layer(layer, h, **kw)`: the stack itself (defaults read `language_model`).
- `row_end_token` (constructor argument or attribute): a text-vocabulary id fed after the last
  token of every grid row (Emu3, Lumina-mGPT), None for none. With it raster position u lives in
  slot `prefix + u + u // W` (RowEndSlotCache); when a row's last token is fed, the row end is fed
  after it (the next slot) in the same forward and its output is reported as that position's
  output (the distribution of the next row's first token); invalidating the position
  invalidates its row end too. Row-end tokens never enter a grid.

Prompt ids are everything before raster token 0 (image-start or grid-size tokens included).
Slots: every row's prompt (conditional and unconditional) ends at slot `max_prompt_len`, left-padded
with invalid slots: `prefix_len` is `max_prompt_len` for every cache of the model, so rows prefilled
at different times (a request joining the scheduler's running batch) share one map from raster
positions to slots, and an image's keys sit at the same slots whatever prompts it is decoded
beside. The RoPE position of slot s in row r is `s - cache.pad[r]` (the token's index among the
row's real tokens), which is what the model itself uses for an unpadded prompt. `max_prompt_len`
is then what each row's attention reads before the grid: set it to the longest prompt served.
"""
from __future__ import annotations

import abc
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from specdec import masks
from specdec.models.conditions import Prompts, is_prompts
from specdec.models.hf.cache import HFSlotCache, RowEndSlotCache, cache_keyword
from specdec.models.protocol import ForwardOutput, cfg_rows
from specdec.numerics import RowWiseLinears, batch_invariant_enabled


class HFImageModel(nn.Module, abc.ABC):
    """An autoregressive image model over a transformers decoder (see the module docstring).
    Abstract: an adapter defines `language_model`, `embed_image` and `image_logits` (a class that
    lacks one cannot be instantiated), and `unconditional_prompt` when it has a default for CFG.

    Args:
        hf_model: the transformers model (kept as the submodule `hf_model`).
        grid: (H, W) of the image-token grid.
        vocab_size: the image codebook size V (logits and tokens are over [0, V)).
        processor: optional transformers processor / tokenizer for string prompts.
        max_prompt_len: prompt capacity of the caches (slots before raster token 0).
        row_end_token: text-vocabulary id ending every grid row, or None.
    """

    supports_cfg = True     #: CFG through an unconditional prompt (specdec.decoding.runner.check_guidance)
    null_class = None       #: text-conditional: no null class

    def __init__(self, hf_model: nn.Module, *, grid: Tuple[int, int], vocab_size: int, processor=None,
                 max_prompt_len: int = 512, row_end_token: Optional[int] = None):
        super().__init__()
        H, W = (int(g) for g in grid)
        if H < 1 or W < 1:
            raise ValueError(f"grid must be two positive ints, got {grid}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, int) or max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be an int >= 1, got {max_prompt_len!r}")
        self.hf_model = hf_model
        self.processor = processor
        self._grid = (H, W)
        self._vocab_size = int(vocab_size)
        self.max_prompt_len = max_prompt_len
        self.prefix_len = max_prompt_len    #: slots before raster token 0, every row's prompt right-aligned there
        self.row_end_token = None if row_end_token is None else int(row_end_token)
        self.use_specdec_attention()
        # (found once here: a compiled pass must not trace the signature's inspection)
        self._cache_keyword = cache_keyword(next(iter(self.decoder_layers())).forward)

    # ---- hooks a subclass provides ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def language_model(self) -> nn.Module:
        """The transformers decoder stack (embeddings, layers, final norm, rotary embedding)."""

    @abc.abstractmethod
    def embed_image(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image codebook ids [..] -> input embeddings [.., dim]."""

    @abc.abstractmethod
    def image_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [rows, N, dim] -> float32 logits [rows, N, V] over the codebook."""

    def unconditional_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own unconditional prompt for the conditional prompt `ids`; a model without
        one asks the caller for negative prompts."""
        raise ValueError(f"{type(self).__name__} has no default unconditional prompt: pass negative_prompts "
                         "(one per image) for classifier-free guidance")

    # ---- hooks with defaults ------------------------------------------------------------------
    def tokenize(self, text: str) -> torch.Tensor:
        if self.processor is None:
            raise ValueError("string prompts need a processor: save it beside the model (processor.save_pretrained "
                             "into its folder) or pass wrap(model, processor=...); or give token ids")
        return self.processor(text=[text], return_tensors="pt")["input_ids"][0]

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings()(ids)

    def decoder_layers(self) -> Iterable[nn.Module]:
        lm = self.language_model
        return lm.layers[: lm.config.num_hidden_layers]

    def position_ids(self, cache: HFSlotCache, slots: torch.Tensor) -> torch.Tensor:
        """RoPE positions of slots [rows, n]: the index of each slot among its row's real tokens."""
        return slots - cache.pad[:, None]

    def rotary_embeddings(self, h: torch.Tensor, position_ids: torch.Tensor):
        return self.language_model.rotary_emb(h, position_ids=position_ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.norm(h)

    def run_layer(self, layer: nn.Module, h: torch.Tensor, **kw) -> torch.Tensor:
        out = layer(h, attention_mask=None, use_cache=True, **kw)
        return out[0] if isinstance(out, tuple) else out

    # ---- attention -----------------------------------------------------------------------------
    def use_specdec_attention(self) -> None:
        """Register "specdec" and switch the language model's attention to it (only that
        config: a VQ's or vision tower's own attention is left as it is). Plain calls of the
        model then run ordinary causal attention through tree_attention."""
        from specdec.integrations.transformers import NAME, register

        register()
        self.text_config._attn_implementation = NAME

    @property
    def text_config(self):
        return self.language_model.config

    # ---- the ARImageModel protocol -------------------------------------------------------------
    @property
    def grid(self) -> Tuple[int, int]:
        return self._grid

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hidden_dim(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def n_slots(self) -> int:
        """Cache capacity: prompt slots + grid slots (+ a row end per row and a scratch slot)."""
        H, W = self._grid
        extra = H + 1 if self.row_end_token is not None else 0
        return self.max_prompt_len + H * W + extra

    def _param(self) -> torch.Tensor:
        return next(self.language_model.parameters())

    def new_cache(self, batch: int, cfg: bool = False, dtype=None, device=None) -> HFSlotCache:
        c = self.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        p = self._param()
        args = (len(list(self.decoder_layers())), batch, n_kv, self.n_slots, head_dim)
        kw = dict(cfg=cfg, dtype=dtype or p.dtype, device=device or p.device, prefix_len=self.prefix_len)
        if self.row_end_token is not None:
            return RowEndSlotCache(*args, width=self._grid[1], **kw)
        return HFSlotCache(*args, **kw)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Image-codebook ids -> input embeddings (what SSD heads take)."""
        return self.embed_image(tokens.long())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + image head on pre-norm hidden states -> float32 [..., V]."""
        return self.image_logits(self.final_norm(hidden)).float()

    # ---- prompts -------------------------------------------------------------------------------
    def _ids(self, prompt, name: str) -> torch.Tensor:
        if isinstance(prompt, str):
            prompt = self.tokenize(prompt)
        if not isinstance(prompt, torch.Tensor):
            try:
                prompt = torch.as_tensor(prompt)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"{name} must be a string or non-empty 1-D int token ids, got "
                                 f"{type(prompt).__name__} {prompt!r:.60}") from None
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype not in (torch.int32, torch.int64) or prompt.numel() == 0:
            raise ValueError(f"{name} must be a string or non-empty 1-D int token ids, got "
                             f"{tuple(prompt.shape)} {prompt.dtype}")
        return prompt.long()

    def encode_prompts(self, prompts: Sequence, negatives: Optional[Sequence] = None) -> Prompts:
        """Strings (through `tokenize`) or 1-D token ids -> a `Prompts` batch; `negatives`
        (one per prompt, None entries allowed) are CFG's unconditional prompts."""
        cond = [self._ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        neg = None
        if negatives is not None:
            neg = [None if n is None else self._ids(n, f"negative_prompts[{i}]") for i, n in enumerate(negatives)]
        return Prompts(cond, neg)

    def prepare_prompts(self, cond, uncond=None):
        """The prompts as the prefill writes them, (cond, uncond): a subclass adds what its model
        expects at the end of a prompt (an image header, a generation suffix)."""
        return cond, uncond

    def check_prompts(self, cond, cfg: bool = False) -> None:
        """Raise what a prefill of the prompts `cond` would raise about the prompts themselves
        (token ids out of range, a row longer than `max_prompt_len`), without a pass: the
        scheduler refuses a request when it is submitted, not in a step that other images share."""
        self._check_lengths(self._prompt_rows(len(cond.cond), cfg, *self.prepare_prompts(cond)))

    #: what the rows of prompts (`prompt_additions`) and of negative prompts (`negative_additions`)
    #: hold besides the caller's tokens, as `_check_lengths`' message names it ("": nothing)
    prompt_additions = negative_additions = ""
    #: what `unconditional_prompt` is, as `_check_lengths` and `_prompt_rows` name it
    unconditional_name = "the model's unconditional prompt"

    def _check_lengths(self, rows: List[Tuple[str, torch.Tensor]]) -> None:
        name, longest = max(rows, key=lambda row: int(row[1].shape[0]))
        L = int(longest.shape[0])
        if L > self.max_prompt_len:
            added = self.prompt_additions if name.startswith("prompts[") else self.negative_additions
            raise ValueError(f"{name} has {L} tokens{added}; the model was wrapped with "
                             f"max_prompt_len={self.max_prompt_len} (wrap(..., max_prompt_len=...))")

    def _prompt_rows(self, batch: int, cfg: bool, cond, uncond) -> List[Tuple[str, torch.Tensor]]:
        """The cache's prompt rows in its order, each with the argument it came from (for errors)."""
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = Prompts(list(cond))
        if not is_prompts(cond):
            if isinstance(cond, (list, tuple)):
                cond = Prompts(list(cond))
            else:
                raise ValueError("cond must be a Prompts batch (or a list of 1-D token ids) for a text-conditional "
                                 "model")
        rows = [(f"prompts[{i}]", self._ids(c, f"prompts[{i}]")) for i, c in enumerate(cond.cond)]
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} prompts for a cache of batch {batch}")
        if cfg:
            negatives = uncond if uncond is not None else cond.negative
            if negatives is not None and len(negatives) != len(rows):
                raise ValueError(f"{len(negatives)} negative prompts for {len(rows)} prompts")
            # each image's conditional row, then its unconditional one (the cache's CFG order)
            paired = []
            for i, (name, c) in enumerate(rows):
                n = None if negatives is None else negatives[i]
                if n is None:
                    negative = (f"{self.unconditional_name} (for {name})", self.unconditional_prompt(c).long())
                else:
                    negative = (f"negative_prompts[{i}]", self._ids(n, f"negative_prompts[{i}]"))
                paired += [(name, c), negative]
            rows = paired
        vocab = self.language_model.get_input_embeddings().num_embeddings
        for name, r in rows:
            if int(r.min()) < 0 or int(r.max()) >= vocab:
                raise ValueError(f"{name} has token ids outside [0, {vocab})")
        return rows

    def prefill(self, cache: HFSlotCache, cond, uncond=None, backend: Optional[str] = None) -> ForwardOutput:
        """Write the prompts (a `Prompts` batch; with a CFG cache the negatives, or the model's
        `unconditional_prompt`, fill each image's second row), each ending at slot
        `prefix_len` (left-padded; one pass over the longest row's slots). Sets `cache.pad`.
        Returns the output at the last prompt slot: the distribution of raster token 0,
        [rows, 1, V]."""
        if batch_invariant_enabled():     # (transformers' linear layers too, row by row)
            with RowWiseLinears():
                return self._prefill(cache, cond, uncond, backend)
        return self._prefill(cache, cond, uncond, backend)

    def _prefill(self, cache: HFSlotCache, cond, uncond, backend: Optional[str]) -> ForwardOutput:
        named = self._prompt_rows(cache.batch, cache.cfg, *self.prepare_prompts(cond, uncond))
        self._check_lengths(named)
        rows = [r for _, r in named]
        lengths = [int(r.shape[0]) for r in rows]
        L = max(lengths)
        device = cache.device
        ids = torch.zeros(cache.rows, L, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, L - lengths[i]:] = r
        P = self.prefix_len
        pad = torch.tensor([P - n for n in lengths], dtype=torch.long)
        ids, pad = ids.to(device), pad.to(device)
        cache.prefix_len = P
        cache.pad.copy_(pad)
        slots = torch.arange(P - L, P, device=device).expand(cache.rows, L)
        real = slots >= pad[:, None]
        h = self.embed_text(ids).to(self._param().dtype)
        hidden = self._run(cache, h, slots, real, None, True, backend, limit=P)
        last = hidden[:, -1:]
        return ForwardOutput(self.head(last), last)

    # ---- forwards ------------------------------------------------------------------------------
    def forward_tokens(self, cache: HFSlotCache, tokens: torch.Tensor, positions: torch.Tensor, *,
                       tree_mask: Optional[torch.Tensor] = None, write: bool = True,
                       backend: Optional[str] = None, checked: bool = True,
                       reach: Optional[int] = None) -> ForwardOutput:
        """Feed image tokens [B, N] (or [rows, N]) at raster positions [N], [B, N] or [rows, N],
        exactly as specdec.models.gpt.LlamaGenGPT.forward_tokens: query i sees the valid cached
        slots at positions <= its own and the new tokens at positions <= its own (and in
        `tree_mask` [rows or B, N, ceil(N/32)] when given); `write=False` leaves the cache as it
        was; `checked=False` skips the value checks (no host reads) and reads the whole cache, or
        the slots up to raster position `reach` when given. Returns float32 logits [rows, N, V]
        and pre-norm hidden states [rows, N, dim]; output n is the distribution of the raster
        token after the one fed at n (with row ends: after the row end that follows it)."""
        if batch_invariant_enabled():     # (transformers' linear layers too, row by row)
            with RowWiseLinears():
                return self._forward_tokens(cache, tokens, positions, tree_mask, write, backend, checked, reach)
        return self._forward_tokens(cache, tokens, positions, tree_mask, write, backend, checked, reach)

    def _forward_tokens(self, cache: HFSlotCache, tokens: torch.Tensor, positions: torch.Tensor, tree_mask, write: bool,
                        backend: Optional[str], checked: bool, reach: Optional[int]) -> ForwardOutput:
        H, W = self._grid
        tokens = cache.check_tokens(tokens)
        if positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be int32/int64, got {positions.dtype}")
        pos = cache.check_slots(positions, "positions", check_range=False)   # [rows, N] int64
        N = tokens.shape[1]
        if pos.shape[1] != N:
            raise ValueError(f"positions has {pos.shape[1]} entries for {N} tokens")
        if tree_mask is not None:
            words = masks.num_words(N)
            if tree_mask.dtype != torch.int32 or tree_mask.dim() != 3 or tree_mask.shape[1:] != (N, words):
                raise ValueError(f"tree_mask must be int32 [B, {N}, {words}], got {tuple(tree_mask.shape)} "
                                 f"{tree_mask.dtype}")
            if tree_mask.shape[0] == cache.batch and cache.cfg:
                tree_mask = cfg_rows(tree_mask)
            if tree_mask.shape[0] != cache.rows:
                raise ValueError(f"tree_mask has {tree_mask.shape[0]} rows, the cache {cache.rows}")
        if checked:
            if N == 0:
                raise ValueError("positions must not be empty")
            lo, hi = (int(t) for t in torch.aminmax(tokens))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"tokens must lie in [0, {self.vocab_size})")
            lo, hi = (int(t) for t in torch.aminmax(pos))
            if lo < 0 or hi >= H * W:
                raise ValueError(f"positions must lie in [0, {H * W})")
            if write and N > 1 and bool((pos.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise ValueError("positions must not repeat within a row when write=True")
        slots = cache.position_slots(pos)
        h = self.embed_image(tokens.long()).to(self._param().dtype)
        live = torch.ones_like(slots, dtype=torch.bool)
        companion = None
        if self.row_end_token is not None:
            h, slots, live, tree_mask, companion = self._with_row_ends(cache, h, pos, slots, tree_mask, checked)
        if batch_invariant_enabled():
            limit = cache.n_slots   # a fixed key count, as gpt.py
        elif checked:
            limit = int(torch.where(live, slots, 0).max()) + 1
        elif reach is not None:
            limit = min(cache.n_slots, cache.slot_limit(int(reach)))
        else:
            limit = cache.n_slots
        hidden = self._run(cache, h, slots, live, tree_mask, write, backend, limit=limit)
        out = hidden[:, :N]
        if companion is not None:
            # a row's last position reports its row end's output
            ends = hidden[:, N:]
            pick = ends.gather(1, companion.clamp(min=0)[..., None].expand(-1, -1, ends.shape[2]))
            out = torch.where((companion >= 0)[..., None], pick, out)
        return ForwardOutput(self.head(out), out)

    def _with_row_ends(self, cache, h, pos, slots, tree_mask, checked):
        """Append the row-end companions of the block: M of them (every token in the unchecked
        path, which reads nothing back; the most row ends of any row in the checked path), the
        live ones at the row-end slots of positions at a row's end, the others at the scratch
        slot, never valid (their outputs are discarded)."""
        W = self._grid[1]
        N = pos.shape[1]
        is_end = pos % W == W - 1
        M = int(is_end.sum(dim=1).max()) if checked else N
        if M == 0:
            return h, slots, torch.ones_like(slots, dtype=torch.bool), tree_mask, None
        # the row-end tokens first, in block order (a stable sort of "not an end")
        order = torch.sort((~is_end).to(torch.int8), dim=1, stable=True).indices[:, :M]
        on = is_end.gather(1, order)
        end_slots = torch.where(on, slots.gather(1, order) + 1, torch.full_like(order, cache.scratch_slot))
        companion = torch.where(is_end, is_end.long().cumsum(dim=1) - 1, torch.full_like(pos, -1))
        ids = torch.full((pos.shape[0], M), self.row_end_token, dtype=torch.long, device=pos.device)
        h = torch.cat([h, self.embed_text(ids).to(h.dtype)], dim=1)
        live = torch.cat([torch.ones_like(slots, dtype=torch.bool), on], dim=1)
        if tree_mask is not None:
            tree_mask = self._tree_with_row_ends(tree_mask, order, N, M)
        return h, torch.cat([slots, end_slots], dim=1), live, tree_mask, companion

    @staticmethod
    def _tree_with_row_ends(tree_mask, order, N, M):
        """The tree over [tokens ; row ends]: the row end of token j sees what j sees, j and
        itself; a token sees the row end of j iff it sees j and is not j (as if fed in turn)."""
        t = masks.unpack(tree_mask, N)                                   # [rows, N, N]
        rows = t.shape[0]
        not_self = order[:, None, :] != torch.arange(N, device=order.device)[None, :, None]   # [rows, N, M]
        tok_end = t.gather(2, order[:, None, :].expand(rows, N, M)) & not_self
        end_tok = t.gather(1, order[:, :, None].expand(rows, M, N))      # [rows, M, N]
        end_end = end_tok.gather(2, order[:, None, :].expand(rows, M, M)) & (order[:, :, None] != order[:, None, :])
        end_end = end_end | torch.eye(M, dtype=torch.bool, device=order.device)
        dense = torch.cat([torch.cat([t, tok_end], 2), torch.cat([end_tok, end_end], 2)], 1)
        return masks.pack(dense)

    def _run(self, cache: HFSlotCache, h: torch.Tensor, slots: torch.Tensor, live: torch.Tensor,
             tree_mask: Optional[torch.Tensor], write: bool, backend: Optional[str], limit: int) -> torch.Tensor:
        """The decoder over h [rows, n, dim] at slots [rows, n] (`live`: the entries that become
        valid; the others are invisible to every query) -> pre-norm hidden [rows, n, dim]."""
        q_pos = slots.to(torch.int32)
        in_place = write and tree_mask is None
        if in_place:
            # write first, then attend over the cache: the new keys are found at their slots
            cache.valid.scatter_(1, slots, live)
            kv_valid, kv_pos = cache.valid[:, :limit], cache.kv_pos[:, :limit]
        else:
            # [cache with the new slots hidden ; new block]: the block last, as tree_mask expects
            old = cache.valid.clone().scatter_(1, slots, False)[:, :limit]
            kv_valid = torch.cat([old, live], dim=1)
            kv_pos = torch.cat([cache.kv_pos[:, :limit], q_pos], dim=1)
        position_ids = self.position_ids(cache, slots)
        position_embeddings = self.rotary_embeddings(h, position_ids)
        visibility = dict(q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask,
                          tree_attention_backend=backend)
        cache.begin_step(slots, write=write, in_place=in_place, limit=limit)
        try:
            for layer in self.decoder_layers():
                h = self.run_layer(layer, h, position_ids=position_ids, **{self._cache_keyword: cache},
                                   position_embeddings=position_embeddings, **visibility)
        finally:
            cache.end_step()
        if write and not in_place:
            cache.valid.scatter_(1, slots, live)
        return h
