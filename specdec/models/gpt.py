"""A LlamaGen-style class-conditional GPT implementing the ARImageModel protocol.

Module names and shapes follow LlamaGen's `autoregressive/models/gpt.py`, so its GPT-B/L/XL
checkpoints load as they are (see loaders.py): `tok_embeddings`, `cls_embedding.embedding_table`
(with the null-class row used by classifier-free guidance), `layers.{i}.attention.{wqkv,wo}`,
`layers.{i}.feed_forward.{w1,w2,w3}`, `layers.{i}.{attention_norm,ffn_norm}`, `norm`, `output`,
no biases. The numerics follow it too: RMSNorm in fp32, SwiGLU, the 2-D rotary embedding of
rope.py (which zeroes q and k of the prefix slots).

`model_type="t2i"` is LlamaGen's text-to-image variant: `cls_embedding` is then the caption
embedder of captions.py (`cls_embedding.cap_proj.{fc1,fc2}`, `cls_embedding.uncond_embedding`),
the prefix is `cls_token_num` (120) caption slots, and the condition is a `Prompts` batch of
caption features [L_i, caption_dim], left-padded with invalid slots (see captions.py).

Slots: the condition occupies slots [0, P) (P = cls_token_num), raster token u occupies slot P + u.
The output at slot s is the distribution of the token that follows it: the prefix's last slot
predicts token 0, token u's slot predicts token u + 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.attention import attend
from specdec.models.captions import CaptionEmbedder, left_pad
from specdec.models.conditions import is_prompts
from specdec.numerics import RowLinear, batch_invariant_enabled
from specdec.models.kv_cache import SlotKVCache
from specdec.models.protocol import ForwardOutput, cfg_rows, join_cfg
from specdec.models.rope import apply_rope, rope_table_2d, rotation_factors


def _round_up(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass
class GPTConfig:
    vocab_size: int = 16384
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    num_classes: int = 1000
    class_dropout_prob: float = 0.1  # > 0 adds the null-class row used by CFG
    cls_token_num: int = 1
    grid_size: int = 16              # tokens per side (LlamaGen's block_size = grid_size ** 2), or rows
    grid_width: Optional[int] = None  # tokens per row of a grid that is not square (None: grid_size)
    initializer_range: float = 0.02
    model_type: str = "c2i"          # "t2i": caption embedder instead of the class table (captions.py)
    caption_dim: int = 2048          # t2i: width of the caption features (flan-t5-xl's)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return _round_up(hidden, self.multiple_of)

    @property
    def grid(self) -> Tuple[int, int]:
        """(H, W): grid_size rows of grid_width (default grid_size) tokens."""
        return (self.grid_size, self.grid_width or self.grid_size)

    def to_dict(self) -> dict:
        return asdict(self)


# LlamaGen's class-conditional sizes (the checkpoints store no config, only weights).
LLAMAGEN_CONFIGS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    # LlamaGen's text-conditional sizes (its released t2i checkpoints are GPT-XL)
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32 whatever the activation dtype, as LlamaGen does
        # (torch's fused rms_norm computes the same formula in one op).
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return out.type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = RowLinear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = RowLinear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = RowLinear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.dim % config.n_head:
            raise ValueError(f"dim {config.dim} is not a multiple of n_head {config.n_head}")
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        self.head_dim = config.head_dim
        self.dim = config.dim
        self.wqkv = RowLinear(config.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = RowLinear(config.dim, config.dim, bias=False)

    def qkv(self, x: torch.Tensor, cos_sin):
        """x [B, N, dim] -> q [B, Hq, N, hd], k, v [B, Hkv, N, hd] with the rotary embedding applied
        (`cos_sin`: rope.rotation_factors of the tokens' slots)."""
        B, N, _ = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv, kv], dim=-1)
        q = apply_rope(q.view(B, N, self.n_head, self.head_dim), cos_sin)
        k = apply_rope(k.view(B, N, self.n_kv_head, self.head_dim), cos_sin)
        v = v.view(B, N, self.n_kv_head, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        B, _, N, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, N, self.dim))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes: int, dim: int, with_null: bool):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(with_null), dim)


class LlamaGenGPT(nn.Module):
    """Class-conditional (or, with model_type="t2i", caption-conditional) raster AR model over a
    `grid_size x grid_size` token grid (`grid_size x grid_width` when grid_width is set: the 2-D
    rotary embedding then runs over (row, column) of the H x W grid)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.head_dim % 4:
            raise ValueError(f"head_dim {config.head_dim} must be a multiple of 4 (2-D rotary embedding)")
        if config.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type must be 'c2i' or 't2i', got {config.model_type!r}")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        if config.model_type == "t2i":
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim, config.cls_token_num)
        else:
            self.cls_embedding = LabelEmbedder(config.num_classes, config.dim, config.class_dropout_prob > 0)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = RowLinear(config.dim, config.vocab_size, bias=False)
        # Not a checkpoint entry (LlamaGen recomputes it too) and not a buffer: it stays fp32
        # when the model is cast to bf16/fp16, as LlamaGen's freqs_cis does.
        self._rope_cpu = rope_table_2d(config.grid, config.head_dim, config.rope_base, config.cls_token_num)
        self._rope_on = {}
        self.reset_parameters()

    def rope_table(self, device) -> torch.Tensor:
        """The fp32 (cos, sin) table [P + H*W, head_dim/2, 2] on `device` (cached per device)."""
        key = str(device)
        if key not in self._rope_on:
            self._rope_on[key] = self._rope_cpu.to(device)
        return self._rope_on[key]

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
        nn.init.zeros_(self.output.weight)

    # ---- the ARImageModel protocol -------------------------------------------------------
    @property
    def grid(self) -> Tuple[int, int]:
        return self.config.grid

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def prefix_len(self) -> int:
        return self.config.cls_token_num

    @property
    def text_conditional(self) -> bool:
        return self.config.model_type == "t2i"

    @property
    def num_classes(self) -> Optional[int]:
        return None if self.text_conditional else self.config.num_classes

    @property
    def null_class(self) -> Optional[int]:
        """Class id of the unconditional (CFG) embedding, None when the model has none (t2i included)."""
        if self.text_conditional:
            return None
        return self.config.num_classes if self.config.class_dropout_prob > 0 else None

    @property
    def supports_cfg(self) -> bool:
        """CFG needs an unconditional input: the null class, or a t2i model's uncond_embedding."""
        return self.text_conditional or self.null_class is not None

    @property
    def compilable_prefill(self) -> bool:
        """Class ids in, no host read on the way (see the protocol): compile=True compiles the prefill."""
        return not self.text_conditional

    @property
    def hidden_dim(self) -> int:
        return self.config.dim

    @property
    def n_slots(self) -> int:
        return self.prefix_len + self.config.grid[0] * self.config.grid[1]

    def new_cache(self, batch: int, cfg: bool = False, dtype=None, device=None) -> SlotKVCache:
        if cfg and not self.supports_cfg:
            raise ValueError("cfg=True needs a model with a null class (class_dropout_prob > 0)")
        p = self.tok_embeddings.weight
        return SlotKVCache(self.config.n_layer, batch, self.layers[0].attention.n_kv_head, self.n_slots,
                           self.config.head_dim, cfg=cfg, dtype=dtype or p.dtype, device=device or p.device,
                           prefix_len=self.prefix_len)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens.long())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm + LM head on pre-norm hidden states -> float32 logits."""
        return self.output(self.norm(hidden)).float()

    def condition_embeddings(self, classes: torch.Tensor) -> torch.Tensor:
        """[B] class ids (the null class allowed) -> [B, P, dim]."""
        if self.text_conditional:
            raise ValueError("a text-to-image LlamaGen model takes caption features (a Prompts batch), not class ids")
        if classes.dim() != 1 or classes.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"classes must be a 1-D int tensor, got {tuple(classes.shape)} {classes.dtype}")
        limit = self.num_classes + (self.null_class is not None)
        # The range check reads the ids back; a compiled prefill (compile=True) cannot, and its
        # decoder checked them once at decode().
        if not torch.compiler.is_compiling() and classes.numel() and (
                int(classes.min()) < 0 or int(classes.max()) >= limit):
            raise ValueError(f"classes must lie in [0, {limit})")
        emb = self.cls_embedding.embedding_table(classes.long()).unsqueeze(1)
        return emb.expand(-1, self.prefix_len, -1)

    def caption_inputs(self, prompts, with_uncond: bool = False):
        """t2i: a Prompts batch -> (prefix embeddings [rows, P, dim], valid [rows, P]) of the cache
        rows (with `with_uncond` each image's unconditional row after its conditional one)."""
        if not self.text_conditional:
            raise ValueError("caption features need a text-to-image model (model_type='t2i')")
        if not is_prompts(prompts):
            raise ValueError("a text-to-image LlamaGen model takes a Prompts batch of caption features "
                             f"[L, {self.config.caption_dim}], got {type(prompts).__name__}")
        captions = self.cls_embedding.rows(prompts.cond, prompts.negative, with_uncond)
        weight = self.tok_embeddings.weight
        feats, valid = left_pad(captions, self.prefix_len, device=weight.device, dtype=weight.dtype)
        return self.cls_embedding(feats), valid

    def prefill(self, cache: SlotKVCache, cond: torch.Tensor, uncond: Optional[torch.Tensor] = None,
                backend: Optional[str] = None) -> ForwardOutput:
        """Write the condition into slots [0, P). `cond`: class ids [B] or embeddings [B, P, dim]
        (a t2i model: a `Prompts` batch of caption features, see captions.py). With a CFG cache
        the unconditional rows get the null class (or `uncond` embeddings; t2i: the negative
        captions, else the model's unconditional caption).
        Returns the output at the last prefix slot: the distribution of token 0, [rows, 1, V]."""
        if self.text_conditional or is_prompts(cond):
            if is_prompts(cond) and len(cond) != cache.batch:
                raise ValueError(f"prompts has {len(cond)} entries for a cache of batch {cache.batch}")
            if uncond is not None:
                raise ValueError("uncond is for embedding conditions; a Prompts batch carries its negative captions")
            emb, valid = self.caption_inputs(cond, with_uncond=cache.cfg)
            slots = torch.arange(self.prefix_len, device=cache.device).expand(cache.rows, -1)
            out = self._run(cache, emb, slots, None, True, backend, prefix_valid=valid.to(cache.device))
            return ForwardOutput(out.logits[:, -1:], out.hidden[:, -1:])
        if cond.dim() == 1:
            if cond.shape[0] != cache.batch:
                raise ValueError(f"cond has {cond.shape[0]} classes for a cache of batch {cache.batch}")
            emb = self.condition_embeddings(cond)
            if cache.cfg:
                null = torch.full_like(cond, self.null_class)
                emb = join_cfg(emb, self.condition_embeddings(null))
        else:
            if cond.dim() != 3 or cond.shape[1:] != (self.prefix_len, self.config.dim):
                raise ValueError(f"cond embeddings must be [B, {self.prefix_len}, {self.config.dim}], got "
                                 f"{tuple(cond.shape)}")
            emb = cond
            if cache.cfg:
                if uncond is None or uncond.shape != cond.shape:
                    raise ValueError("a CFG cache with embedding conditions needs `uncond` of the same shape")
                emb = join_cfg(cond, uncond)
        if emb.shape[0] != cache.rows:
            raise ValueError(f"cond gives {emb.shape[0]} rows for a cache of {cache.rows}")
        slots = torch.arange(self.prefix_len, device=cache.device).expand(cache.rows, -1)
        # The slots are [0, P): the attention limit is known without reading them (a traceable prefill).
        out = self._run(cache, emb.to(self.tok_embeddings.weight.dtype), slots, None, True, backend,
                        limit=self.prefix_len)
        return ForwardOutput(out.logits[:, -1:], out.hidden[:, -1:])

    def forward_tokens(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor, *,
                       tree_mask: Optional[torch.Tensor] = None, write: bool = True,
                       backend: Optional[str] = None, checked: bool = True,
                       reach: Optional[int] = None) -> ForwardOutput:
        """Feed tokens [B, N] (or [rows, N]) at raster positions [N] or [B, N].

        Query i sees the valid cached slots at positions <= its own plus the new tokens at
        positions <= its own (restricted further by `tree_mask` [rows, N, ceil(N/32)] int32 over
        the new block). `write=False` scores the tokens without touching the cache (a verification
        that will be redone). Returns logits [rows, N, V] (float32; the distribution of the token
        after each fed one) and the pre-norm hidden states [rows, N, dim].

        `checked=False` is the decoders' fast path: shapes and dtypes are still checked, but not
        the values (token ids and positions in range, positions not repeated), which would read
        them back to the host on every pass; attention then reads the whole cache (a fixed key
        count, the same shapes every pass) instead of the prefix the positions reach, unless the
        caller passes `reach`, a host-side bound on the positions it knows without reading them
        (AR's step index): then only slots up to that position are read, as in the checked path."""
        if not checked:
            return self._forward_unchecked(cache, tokens, positions, tree_mask, write, backend, reach)
        tokens = cache.check_tokens(tokens)
        if tokens.numel():
            lo, hi = torch.aminmax(tokens)
            if int(lo) < 0 or int(hi) >= self.vocab_size:
                raise ValueError(f"tokens must lie in [0, {self.vocab_size})")
        hw = self.config.grid[0] * self.config.grid[1]
        if positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be int32/int64, got {positions.dtype}")
        if positions.numel() == 0:
            raise ValueError("positions must not be empty")
        lo, hi = (int(t) for t in torch.aminmax(positions))
        if lo < 0 or hi >= hw:
            raise ValueError(f"positions must lie in [0, {hw})")
        slots = cache.check_slots(positions.to(cache.device).long() + self.prefix_len, "positions",
                                  check_range=False)
        if slots.shape[1] != tokens.shape[1]:
            raise ValueError(f"positions has {slots.shape[1]} entries for {tokens.shape[1]} tokens")
        # Tree drafts may hold several candidates for one position; only one can be cached.
        if write and slots.shape[1] > 1 and bool((slots.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError("positions must not repeat within a row when write=True")
        if tree_mask is not None:
            words = (tokens.shape[1] + 31) // 32
            if tree_mask.dtype != torch.int32 or tree_mask.shape[1:] != (tokens.shape[1], words):
                raise ValueError(f"tree_mask must be int32 [B, {tokens.shape[1]}, {words}], got "
                                 f"{tuple(tree_mask.shape)} {tree_mask.dtype}")
            if tree_mask.shape[0] == cache.batch and cache.cfg:
                tree_mask = cfg_rows(tree_mask)
        return self._run(cache, self.embed_tokens(tokens), slots, tree_mask, write, backend,
                         limit=hi + self.prefix_len + 1)

    def _forward_unchecked(self, cache, tokens, positions, tree_mask, write, backend, reach=None) -> ForwardOutput:
        if tokens.shape[0] == cache.batch and cache.cfg:
            tokens = cfg_rows(tokens)
        slots = cache.check_slots(positions.long() + self.prefix_len, "positions", check_range=False)
        if tree_mask is not None and tree_mask.shape[0] == cache.batch and cache.cfg:
            tree_mask = cfg_rows(tree_mask)
        limit = cache.n_slots if reach is None else min(cache.n_slots, reach + self.prefix_len + 1)
        return self._run(cache, self.embed_tokens(tokens), slots, tree_mask, write, backend, limit=limit)

    def _run(self, cache, h, slots, tree_mask, write, backend, limit=None, prefix_valid=None) -> ForwardOutput:
        cos_sin = rotation_factors(self.rope_table(h.device)[slots])
        q_pos = slots.to(torch.int32)
        # Slots after the last query's position are invisible to every query: attention reads
        # only the cache prefix [0, limit) (a view; plain AR then costs O(u) at step u, not O(HW)).
        limit = limit or int(slots.max()) + 1
        if batch_invariant_enabled():
            limit = cache.n_slots   # a fixed key count: the softmax then sums the same terms in any batch
        in_place = write and tree_mask is None
        if in_place:
            # Write first, then attend over the cache: the new keys are found at their slots.
            # `prefix_valid` (a t2i prefill): caption padding slots are written but stay invalid.
            cache.valid.scatter_(1, slots, True if prefix_valid is None else prefix_valid)
            kv_valid, kv_pos = cache.valid[:, :limit], cache.kv_pos[:, :limit]
        else:
            # Attend over [cache with the new slots hidden ; new block]: the block is last, as
            # tree_attention's tree_mask expects, and the cache is untouched unless `write`.
            old_valid = cache.valid.clone().scatter_(1, slots, False)[:, :limit]
            kv_valid = torch.cat([old_valid, torch.ones_like(slots, dtype=torch.bool)], dim=1)
            kv_pos = torch.cat([cache.kv_pos[:, :limit], q_pos], dim=1)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention.qkv(layer.attention_norm(h), cos_sin)
            if in_place:
                cache.write(i, slots, k, v)
                out = attend(q, cache.k[i][:, :, :limit], cache.v[i][:, :, :limit], q_pos=q_pos,
                             kv_pos=kv_pos, kv_valid=kv_valid, backend=backend)
            else:
                out = attend(q, torch.cat([cache.k[i][:, :, :limit], k.to(cache.k[i].dtype)], 2),
                             torch.cat([cache.v[i][:, :, :limit], v.to(cache.v[i].dtype)], 2),
                             q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask, backend=backend)
                if write:
                    cache.write(i, slots, k, v)
            h = h + layer.attention.merge(out.to(h.dtype))
            h = h + layer.feed_forward(layer.ffn_norm(h))
        if write and not in_place:
            cache.valid.scatter_(1, slots, True)
        return ForwardOutput(self.head(h), h)

    # ---- training / teacher forcing (no cache) ------------------------------------------------
    def teacher_forward(self, tokens: torch.Tensor, classes) -> ForwardOutput:
        """Full causal pass over [condition ; tokens [B, L]] (L <= H*W) -> outputs at all P + L
        slots. Uses torch's SDPA (differentiable) instead of tree_attention: this is the training
        path; tests check it against the cached protocol path. `classes`: class ids [B], or for a
        t2i model a Prompts batch of B captions (their conditional rows only): the causal mask then
        hides the caption padding slots from every query but themselves, as LlamaGen's emb_masks do."""
        B, L = tokens.shape
        mask = None
        if self.text_conditional:
            cond, valid = self.caption_inputs(classes)
            S = self.prefix_len + L
            keys = torch.cat([valid, valid.new_ones(B, L)], dim=1)                       # [B, S]
            causal = torch.ones(S, S, dtype=torch.bool, device=valid.device).tril()
            eye = torch.eye(S, dtype=torch.bool, device=valid.device)
            mask = ((causal & keys[:, None, :]) | eye)[:, None]                          # [B, 1, S, S]
        else:
            cond = self.condition_embeddings(classes)
        h = torch.cat([cond, self.embed_tokens(tokens)], dim=1)
        cos_sin = rotation_factors(self.rope_table(h.device)[: h.shape[1]].unsqueeze(0))
        for layer in self.layers:
            q, k, v = layer.attention.qkv(layer.attention_norm(h), cos_sin)
            if k.shape[1] != q.shape[1]:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + layer.attention.merge(out)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        return ForwardOutput(self.head(h), h)

    def training_loss(self, tokens: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy of tokens [B, H*W] given classes [B] (already label-dropped)."""
        logits = self.teacher_forward(tokens[:, :-1], classes).logits[:, self.prefix_len - 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1).long())
