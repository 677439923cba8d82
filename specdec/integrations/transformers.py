"""`attn_implementation="specdec"`: transformers attention through `specdec.ops.tree_attention`.

    from specdec.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="specdec")
    # multimodal models: only the language model, the VQ / vision towers keep their own attention
    model = JanusForConditionalGeneration.from_pretrained(path, attn_implementation={"text_config": "specdec"})

The visibility rule travels through the forward's keyword arguments (transformers 5 passes
`**kwargs` from the model's forward down to the attention function), not through a dense mask:

    model.model(inputs_embeds=h, position_ids=p, cache=cache,   # past_key_values= before transformers 5.25
                q_pos=q_pos, kv_pos=kv_pos, kv_valid=kv_valid, tree_mask=tree_mask)

with `tree_attention`'s rule: key j is visible to query i iff `kv_valid[b, j]` and
`kv_pos[b, j] <= q_pos[b, i]` and, for the last Nq keys when `tree_mask` is given, bit
`j - (Nk - Nq)` of `tree_mask[b, i]` (specdec.masks packs it). `q_pos` [B, Nq] and `kv_pos`
[B, Nk] are int32/int64, `kv_valid` [B, Nk] bool, `tree_mask` [B, Nq, ceil(Nq/32)] int32;
`tree_attention_backend` picks the backend (None: automatic). specdec's transformers adapters
(specdec.models.hf) pass exactly these.

Called without them (a plain `model(...)` or `generate`), the function is ordinary attention:
causal when transformers passes no mask (sdpa's `is_causal`: upper-left aligned), or the mask
transformers built (the "specdec" mask function is sdpa's), which for decoder language models is
causal + key padding and is translated exactly into the rule: `kv_valid[j]` = some query sees key
j, `q_pos[i]` = the last key query i sees, `kv_pos[j] = j`. A mask that is not of that form (a
sliding window, Llama 4's chunks, a block-diagonal mask of packed sequences) cannot be written so:
the translation is checked against the mask and such a call is refused, as are softcapping,
attention sinks and attention dropout. The kernels have no backward: a loss through them raises
on `backward()` (ops.tree_attention), so fine-tune with another attention.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from specdec import masks

NAME = "specdec"
#: The keyword arguments the attention function reads (everything else is ignored).
VISIBILITY_KWARGS = ("q_pos", "kv_pos", "kv_valid", "tree_mask", "tree_attention_backend")


def register() -> None:
    """Register "specdec" with transformers' AttentionInterface and AttentionMaskInterface
    (idempotent). After this, `attn_implementation="specdec"` works in `from_pretrained`,
    `from_config` and `model.set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, specdec_attention_forward)
    # The mask of plain calls: sdpa's (None for a pure causal mask, else a bool [B, 1, Nq, Nk]).
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _plain_visibility(query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      causal: bool):
    """q_pos, kv_pos, kv_valid of a call without visibility kwargs (see the module docstring)."""
    B, _, Nq, _ = query.shape
    Nk = key.shape[2]
    device = query.device
    kv_pos = torch.arange(Nk, device=device, dtype=torch.int32).expand(B, Nk)
    if attention_mask is None:
        # No mask means what sdpa's is_causal means: upper-left causal for Nq > 1 (transformers
        # skips the mask only when that is right: Nq == Nk, or a prefill into an empty static
        # cache), every key for a single query or a non-causal module.
        if causal and Nq > 1:
            last = torch.arange(Nq, device=device, dtype=torch.int32)
        else:
            last = torch.full((Nq,), Nk - 1, device=device, dtype=torch.int32)
        return last.expand(B, Nq), kv_pos, None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != Nk or attention_mask.shape[-2] != Nq:
        raise ValueError(f"attention_mask must be [B, 1, {Nq}, {Nk}] for the specdec attention, got "
                         f"{tuple(attention_mask.shape)}")
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0].expand(B, Nq, Nk)
    kv_valid = visible.any(dim=1)
    # The last visible key of each query (-1: the query sees nothing, e.g. a padding query).
    idx = torch.arange(Nk, device=device)
    q_pos = torch.where(visible, idx, -1).amax(dim=2).to(torch.int32)
    _check_translated(attention_mask, visible, q_pos, kv_pos, kv_valid)
    return q_pos, kv_pos, kv_valid


#: The mask `_check_translated` last found to be causal + key padding, and its version: transformers
#: passes one mask object to every layer of a forward, so it is checked once per forward.
_checked_mask = (None, None)


def _check_translated(mask: torch.Tensor, visible: torch.Tensor, q_pos, kv_pos, kv_valid) -> None:
    """Refuse a mask the rule cannot express (a chunked or block-diagonal mask, packed sequences): the
    rule's visibility must be the mask's, key for key (one host read per mask and version; a mask
    made under `inference_mode` has no version counter, so it is known by itself alone). Skipped
    while torch.compile traces, which cannot read the host: a model only ever run compiled is not
    checked (docs/hf.md)."""
    global _checked_mask
    if torch.compiler.is_compiling():
        return
    version = None if mask.is_inference() else mask._version
    last, last_version = _checked_mask
    if last is not None and last() is mask and last_version == version:
        return
    if not torch.equal(masks.visibility(q_pos, kv_pos, kv_valid), visible):
        raise ValueError("attention_mask is not a causal mask with key padding (a chunked or block-diagonal "
                         "mask, packed sequences, a sliding window?): the specdec attention cannot express it")
    _checked_mask = (weakref.ref(mask), version)


def specdec_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, q_pos: Optional[torch.Tensor] = None,
                              kv_pos: Optional[torch.Tensor] = None, kv_valid: Optional[torch.Tensor] = None,
                              tree_mask: Optional[torch.Tensor] = None,
                              tree_attention_backend: Optional[str] = None, **kwargs):
    """The "specdec" attention function: query [B, Hq, Nq, D], key/value [B, Hkv, Nk, D] ->
    (output [B, Nq, Hq, D], None), transformers' attention-function contract."""
    from specdec import ops

    if kwargs.get("softcap") is not None:
        raise ValueError("the specdec attention does not support softcap")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("the specdec attention does not support sliding-window layers")
    if kwargs.get("s_aux") is not None:
        raise ValueError("the specdec attention does not support attention sinks (s_aux)")
    if dropout and module.training:
        raise ValueError("the specdec attention does not support attention dropout (use eval mode)")
    if q_pos is None:
        if kv_pos is not None or kv_valid is not None or tree_mask is not None:
            raise ValueError("kv_pos, kv_valid and tree_mask need q_pos")
        q_pos, kv_pos, kv_valid = _plain_visibility(query, key, attention_mask,
                                                    bool(getattr(module, "is_causal", True)))
    elif kv_pos is None:
        raise ValueError("q_pos needs kv_pos")
    out = ops.tree_attention(query, key.to(query.dtype), value.to(query.dtype), q_pos=q_pos, kv_pos=kv_pos,
                             kv_valid=kv_valid, tree_mask=tree_mask, scale=scaling, backend=tree_attention_backend)
    return out.transpose(1, 2).contiguous(), None
