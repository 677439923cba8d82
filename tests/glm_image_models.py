"""Tiny random GLM-Image models (`GlmImageForConditionalGeneration`), a tiny GlmImageProcessor, and
GLM-Image's own text-to-image generation (the reference of tests/models/hf/test_hf_glm_image.py).

The tiny vocabulary has GLM-Image's layout in miniature: ids 0 .. K-1 are the VQ codes, K the image
start (the tokenizer's bos), K + 1 the image end (eos), ids up to the LM head's `vision_vocab_size`
(40) unused, then text: `<sop>`, `<eop>`, the digits and the space of the size tail, a few
letters, the image placeholder and the pad token.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

K = 32                 # VQ codes
HEAD = 40              # the LM head's outputs (vision_vocab_size): K codes, bos, eos, unused ids
TEXT = ["<sop>", "<eop>"] + list("0123456789 ") + list("abcdefghijkl")
BOS, EOS = K, K + 1


def vocabulary() -> dict:
    vocab = {f"<|code {c}|>": c for c in range(K)}
    vocab["<|dit_token_16384|>"] = BOS
    vocab["<|dit_token_16385|>"] = EOS
    for i in range(K + 2, HEAD):
        vocab[f"<|unused {i}|>"] = i
    for t in TEXT:
        vocab[t] = len(vocab)
    vocab["<|image|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


VOCAB = vocabulary()
PAD = VOCAB["<|endoftext|>"]
SOP, EOP = VOCAB["<sop>"], VOCAB["<eop>"]


def text_ids(text: str) -> torch.Tensor:
    return torch.tensor([VOCAB[ch] for ch in text], dtype=torch.long)


def tail_ids(grid: Tuple[int, int], preview: Tuple[int, int]) -> torch.Tensor:
    """`<sop>H W<eop><sop>h w<eop>` + bos, one token per character (the tiny tokenizer's split)."""
    (H, W), (h, w) = grid, preview
    return torch.cat([torch.tensor([SOP]), text_ids(f"{H} {W}"), torch.tensor([EOP, SOP]), text_ids(f"{h} {w}"),
                      torch.tensor([EOP, BOS])])


def prompt_ids(text: str, grid, preview) -> torch.Tensor:
    """What GlmImageProcessor(text=[text], target_h=32 H, target_w=32 W) gives (no chat template)."""
    return torch.cat([text_ids(text), tail_ids(grid, preview)])


def tiny_glm_image(*, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                   scale: float = 0.5, mrope_section=(2, 3, 3)):
    """A random GlmImageForConditionalGeneration (float32, eval): head_dim 32 with half of it
    rotated (partial_rotary_factor 0.5, GLM-Image's), M-RoPE sections over the 8 frequencies.
    `scale`: std of the language model's and head's weights (far from uniform logits)."""
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration

    text = dict(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vision_vocab_size=HEAD,
                max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=list(mrope_section)))
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, image_size=32, patch_size=16)
    vq = dict(embed_dim=8, num_embeddings=K, latent_channels=16)
    config = GlmImageConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=VOCAB["<|image|>"],
                            image_start_token_id=BOS, image_end_token_id=EOS)
    config.text_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = GlmImageForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.startswith("model.language_model") or name.startswith("lm_head")):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.requires_grad_(False)


@torch.no_grad()
def glm_generate(model, prompts: Sequence[torch.Tensor], grid, preview):
    """GLM-Image's own greedy generation (transformers' `generate` with `image_grid_thw` =
    [[1, H, W], [1, h, w]], prompts left-padded with their attention mask) of the preview's and
    the target's tokens, the ids past the codes suppressed (the adapter's head is the codes) ->
    (preview [B, h, w], target [B, H, W])."""
    (H, W), (h, w) = grid, preview
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = p
        mask[i, L - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, image_grid_thw=torch.tensor([[1, H, W], [1, h, w]]),
                         max_new_tokens=h * w + H * W, do_sample=False, suppress_tokens=list(range(K, HEAD)),
                         pad_token_id=PAD, eos_token_id=None, top_p=None, top_k=None, temperature=None)
    new = out[:, L:]
    return new[:, :h * w].reshape(-1, h, w), new[:, h * w:].reshape(-1, H, W)


def tiny_processor(chat_template: bool = False):
    """A GlmImageProcessor over the tiny vocabulary: a character-level tokenizer with GLM-Image's
    special tokens (`<sop>`, `<eop>`, the image placeholder, bos = the image start). With
    `chat_template`, a one-line template that wraps each user message in `<sop>` ... `<eop>`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import GlmImageProcessor, PreTrainedTokenizerFast
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|dit_token_16384|>", eos_token="<|dit_token_16385|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"})
    processor = GlmImageProcessor(image_processor=GlmImageImageProcessorPil(), tokenizer=fast)
    if chat_template:
        processor.chat_template = ("{% for m in messages %}<sop>{% for c in m['content'] %}{{ c['text'] }}"
                                   "{% endfor %}<eop>{% endfor %}")
    return processor
