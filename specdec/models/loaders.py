"""Load LlamaGen checkpoints (FoundationVision/LlamaGen) into specdec's models.

    gpt = specdec.models.load_llamagen("c2i_L_256.pt", "GPT-L")          # grid 16 (256 px, VQ-16)
    t2i = specdec.models.load_llamagen("t2i_XL_stage2_512.pt", "GPT-XL", grid_size=32)  # text-to-image
    vq = specdec.models.load_llamagen_vq("vq_ds16_c2i.pt")               # VQ-16
    neighbors = specdec.neighbors.knn_table(vq.codebook, k)              # LANTERN's neighbours

Accepted files: `{"model": state}`, `{"module": state}`, `{"state_dict": state}`, a raw state
dict, or safetensors. Key prefixes added by DDP (`module.`) or torch.compile (`_orig_mod.`) are
stripped; non-weight entries LlamaGen may store (`freqs_cis`, KV-cache buffers, the VQ's
`codebook_used` usage counter) are dropped. Anything else missing or unexpected is an error
that lists the keys. Pickled checkpoints are read with `torch.load(weights_only=True)`; pass
`trust_pickle=True` only for a file you trust that needs full unpickling.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
import zipfile
from typing import Dict, Optional

import torch

from specdec.models.gpt import LLAMAGEN_CONFIGS, GPTConfig, LlamaGenGPT
from specdec.models.llamagen_vq import LLAMAGEN_VQ_CONFIGS, LlamaGenVQ, LlamaGenVQConfig

_DROPPED_SUFFIXES = ("freqs_cis", "kv_cache.k_cache", "kv_cache.v_cache", "causal_mask", "codebook_used")
_WRAPPERS = ("model", "module", "state_dict", "ema")


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or shapes do not match the model built for the given config."""


def read_state_dict(path: str, trust_pickle: bool = False) -> Dict[str, torch.Tensor]:
    """The weights of a checkpoint file, unwrapped and with wrapper prefixes stripped."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            obj = load_file(path)
        except SafetensorError as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
        except Exception as exc:  # weights_only refuses pickled non-tensor objects
            text = str(exc).strip()
            # (torch's refusal is a paragraph; what it refused is on its "WeightsUnpickler error:" line)
            found = re.search(r"WeightsUnpickler error: *(.+)", text)
            first = (found.group(1) if found else text.splitlines()[0] if text else type(exc).__name__)[:200]
            # (torch.save writes a zip archive: only one that holds more than tensors can need unpickling)
            hint = ("; if you trust the file, pass trust_pickle=True"
                    if not trust_pickle and zipfile.is_zipfile(path) else "")
            raise ValueError(f"{path}: cannot be read by torch.load ({first}){hint}") from None
    for _ in range(2):  # e.g. {"model": {"module": ...}}
        if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
            inner = next((obj[k] for k in _WRAPPERS if isinstance(obj.get(k), dict)), None)
            if inner is None:
                break
            obj = inner
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
    state = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            continue
        for prefix in ("module.", "_orig_mod."):
            if k.startswith(prefix):
                k = k[len(prefix):]
        if k.endswith(_DROPPED_SUFFIXES):
            continue
        state[k] = v
    return state


def _load_strict(model: torch.nn.Module, state: Dict[str, torch.Tensor], what: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        def show(keys, fmt=str):
            return ", ".join(fmt(k) for k in keys[:12]) + (f", ... ({len(keys)} in all)" if len(keys) > 12 else "")
        parts = []
        if missing:
            parts.append(f"missing keys: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {show(unexpected)}")
        if wrong:
            parts.append("shape mismatches: " + show(
                wrong, lambda k: f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"))
        raise CheckpointMismatchError(f"{what}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)


#: The config fields a size dict may not set: the loaders take them from the checkpoint (vocabulary,
#: classes, codebook) or from their own arguments (grid, model type).
_DERIVED = {GPTConfig: ("vocab_size", "num_classes", "class_dropout_prob", "grid_size", "grid_width", "model_type"),
            LlamaGenVQConfig: ("codebook_size", "codebook_embed_dim")}


def size_fields(config_name, table: dict, config_class) -> dict:
    """A named LlamaGen size, or a dict of the same fields for a custom (e.g. test) size: only the
    fields a size sets, ints >= 1 where the config has ints (a ValueError names the others, before
    any file is read)."""
    if not isinstance(config_name, dict):
        if config_name not in table:
            raise ValueError(f"config_name must be one of {sorted(table)} (or a dict of {config_class.__name__} "
                             f"fields), got {config_name!r}")
        return table[config_name]
    hints = typing.get_type_hints(config_class)
    allowed = [f.name for f in dataclasses.fields(config_class) if f.name not in _DERIVED[config_class]]
    unknown = sorted(str(k) for k in set(config_name) - set(allowed))
    if unknown:
        raise ValueError(f"{config_name}: no field {', '.join(unknown)} in a {config_class.__name__} size; it "
                         f"takes {', '.join(allowed)}")
    for name, value in config_name.items():
        if hints[name] in (int, Optional[int]) and not (value is None and hints[name] == Optional[int]) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{config_name}: {name} must be an int >= 1, got {value!r}")
    return dict(config_name)


#: LlamaGen's text-to-image prefix: 120 caption slots (its T5 feature length) of flan-t5-xl features.
T2I_CAPTION_SLOTS = 120
T2I_CAPTION_DIM = 2048


def llamagen_gpt_config(config_name, *, vocab_size: int = 16384, num_classes: int = 1000,
                        grid_size: int = 16, with_null_class: bool = True, model_type: str = "c2i",
                        caption_dim: int = T2I_CAPTION_DIM, caption_slots: int = T2I_CAPTION_SLOTS) -> GPTConfig:
    """A LlamaGen size as a GPTConfig; model_type="t2i" gives the text-to-image variant
    (`caption_slots` prefix slots of `caption_dim` features)."""
    fields = size_fields(config_name, LLAMAGEN_CONFIGS, GPTConfig)
    if model_type == "t2i":
        fields = dict(dict(cls_token_num=caption_slots, caption_dim=caption_dim), **fields)
    return GPTConfig(vocab_size=vocab_size, num_classes=num_classes, grid_size=grid_size,
                     class_dropout_prob=0.1 if with_null_class else 0.0, model_type=model_type, **fields)


_T2I_KEYS = ("cls_embedding.cap_proj.fc1.weight", "cls_embedding.uncond_embedding")


def load_llamagen(path: str, config_name, *, grid_size: int = 16, device=None, dtype=None,
                  trust_pickle: bool = False) -> LlamaGenGPT:
    """A LlamaGen GPT checkpoint, class-conditional or text-to-image, as a LlamaGenGPT (ARImageModel).

    n_layer/n_head/dim come from `config_name` (GPT-B, GPT-L, GPT-XL, ..., or a dict such as
    {"n_layer": 2, "n_head": 2, "dim": 64} for other sizes); vocabulary size and
    class count from the embedding shapes; `grid_size` is image size / 16 for VQ-16 (16 for the
    256 px models, 24 for 384 px, 32 for the 512 px t2i stage-2 model): checkpoints do not store it.

    A checkpoint with a caption embedder (`cls_embedding.cap_proj`, `cls_embedding.uncond_embedding`)
    loads as the text-to-image model: caption width and slot count (LlamaGen's 2048 and 120) come
    from the uncond_embedding's shape; it decodes from caption features (specdec.models.captions)."""
    size_fields(config_name, LLAMAGEN_CONFIGS, GPTConfig)  # a bad name fails before any file I/O
    state = read_state_dict(path, trust_pickle)
    if "tok_embeddings.weight" not in state:
        raise CheckpointMismatchError(f"{path}: missing keys: tok_embeddings.weight (is this a LlamaGen GPT?)")
    vocab = state["tok_embeddings.weight"].shape[0]
    if any(k in state for k in _T2I_KEYS):
        missing = [k for k in _T2I_KEYS if k not in state]
        if missing:
            raise CheckpointMismatchError(f"{path}: missing keys: {', '.join(missing)} (a LlamaGen text-to-image "
                                          "GPT has both)")
        slots, caption_dim = state["cls_embedding.uncond_embedding"].shape
        config = llamagen_gpt_config(config_name, vocab_size=vocab, grid_size=grid_size, model_type="t2i",
                                     caption_dim=caption_dim, caption_slots=slots)
    else:
        if "cls_embedding.embedding_table.weight" not in state:
            raise CheckpointMismatchError(f"{path}: missing keys: cls_embedding.embedding_table.weight (is this a "
                                          "class-conditional LlamaGen GPT? a text-to-image one has "
                                          "cls_embedding.cap_proj and cls_embedding.uncond_embedding)")
        rows = state["cls_embedding.embedding_table.weight"].shape[0]
        # LlamaGen's c2i models are trained with class dropout, so the table has a null-class row.
        config = llamagen_gpt_config(config_name, vocab_size=vocab, num_classes=rows - 1, grid_size=grid_size)
    with torch.device("meta"):
        model = LlamaGenGPT(config)
    model = model.to_empty(device="cpu")
    _load_strict(model, state, f"{path} as {config_name}")
    return model.to(device=device, dtype=dtype).eval()


def load_llamagen_vq(path: str, config_name="VQ-16", *, codebook_size: Optional[int] = None,
                     codebook_embed_dim: Optional[int] = None, device=None,
                     trust_pickle: bool = False) -> LlamaGenVQ:
    """A LlamaGen VQ checkpoint as a LlamaGenVQ (encode / decode / codebook)."""
    fields = size_fields(config_name, LLAMAGEN_VQ_CONFIGS, LlamaGenVQConfig)
    state = read_state_dict(path, trust_pickle)
    emb = state.get("quantize.embedding.weight")
    if emb is None:
        raise CheckpointMismatchError(f"{path}: missing keys: quantize.embedding.weight (is this a LlamaGen VQ?)")
    config = LlamaGenVQConfig(codebook_size=codebook_size or emb.shape[0],
                              codebook_embed_dim=codebook_embed_dim or emb.shape[1],
                              **fields)
    with torch.device("meta"):
        model = LlamaGenVQ(config)
    model = model.to_empty(device="cpu")
    _load_strict(model, state, f"{path} as {config_name}")
    return model.to(device=device).eval()


def llamagen_manifest(config_name: str, **kw) -> Dict[str, tuple]:
    """{key: shape} of a LlamaGen GPT ("GPT-B", ...) or VQ ("VQ-16", "VQ-8") checkpoint, built on
    the meta device (no memory, no download): what a real checkpoint must contain."""
    with torch.device("meta"):
        if isinstance(config_name, str) and config_name in LLAMAGEN_VQ_CONFIGS:
            model = LlamaGenVQ(LlamaGenVQConfig(**LLAMAGEN_VQ_CONFIGS[config_name], **kw))
        else:
            model = LlamaGenGPT(llamagen_gpt_config(config_name, **kw))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
