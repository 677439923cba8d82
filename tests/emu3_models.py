"""Tiny random Emu3 models and Emu3's own image generation (the reference of tests/models/hf/test_hf_emu3.py).

The tiny vocabulary has Emu3's layout in miniature: special tokens (BOS, EOS, `<image>`, the row-end
token `<|extra_200|>`, the end-of-frame `<|extra_201|>`, image start/end and the image wrapper
`<|image token|>`), the digits and `*` of the "H*W" size string, a contiguous range of
`<|visual token NNNNNN|>` entries that does not start at id 0 (so the codebook id is never the
vocabulary id), and a few text tokens after it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

CODEBOOK = 32           # VQ codebook entries = visual tokens
TEXT = "abcdefghijkl"   # the tiny text vocabulary (one token per letter)
SPECIAL = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<image>", "<|extra_200|>", "<|extra_201|>",
           "<|image start|>", "<|image end|>", "<|image token|>"]
PAD, BOS, EOS = 0, 1, 2


def vocabulary(codebook: int = CODEBOOK) -> dict:
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for d in "0123456789*":
        vocab[d] = len(vocab)
    first = len(vocab) + 3                      # a gap: visual ids are not the special ids + c
    for c in range(codebook):
        vocab[f"<|visual token {c:06d}|>"] = first + c
    for j, ch in enumerate(TEXT):
        vocab[ch] = first + codebook + j
    return vocab


VOCAB = vocabulary()
WRAPPER = VOCAB["<|image token|>"]
IMAGE_START = VOCAB["<|image start|>"]
EOL = VOCAB["<|extra_200|>"]
EOF = VOCAB["<|extra_201|>"]


def text_ids(text: str, bos: bool = True) -> torch.Tensor:
    """BOS + one token per letter (what Emu3's processor gives for a text without the image prefix)."""
    return torch.tensor(([BOS] if bos else []) + [VOCAB[ch] for ch in text], dtype=torch.long)


def generation_prompt(text: str, grid) -> torch.Tensor:
    """What `Emu3Processor(text=..., return_for_image_generation=True)` builds: BOS, the text, image
    start, the "H*W" size string, the image wrapper token."""
    H, W = grid
    size = [VOCAB[ch] for ch in f"{H}*{W}"]
    return torch.cat([text_ids(text), torch.tensor([IMAGE_START] + size + [WRAPPER])])


def tiny_emu3(*, seed: int = 0, codebook: int = CODEBOOK, hidden: int = 32, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, scale: float = 0.3, vq_seed: Optional[int] = None):
    """A random Emu3ForConditionalGeneration (float32, eval). `scale`: std of the language model's
    weights (far from uniform logits, so greedy tokens are not decided by rounding); the VQ keeps
    transformers' own initialisation from `vq_seed` (default `seed`), so two models built with one
    vq_seed share the codebook and the pixel decoder."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig

    vocab = vocabulary(codebook)
    text = Emu3TextConfig(vocab_size=max(vocab.values()) + 1, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=512, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                          attention_dropout=0.0)
    # Channel multipliers (1, 2, 1): spatial factor 4, and the middle block's width (32) equals the
    # VQ attention's hidden_size as Emu3VQVAE requires; temporal factor 1: a one-frame image.
    vq = dict(codebook_size=codebook, embed_dim=4, latent_channels=4, temporal_downsample_factor=1,
              base_channels=32, channel_multiplier=[1, 2, 1], num_res_blocks=1, hidden_size=32,
              attn_resolutions=[])
    config = Emu3Config(text_config=text, vq_config=vq, vocabulary_map=vocab)
    config.text_config._attn_implementation = "sdpa"
    torch.manual_seed(seed if vq_seed is None else vq_seed)
    model = Emu3ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.vqmodel"):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.requires_grad_(False)


def allowed_tokens(model, grid):
    """Emu3's documented `prefix_allowed_tokens_fn` (transformers' Emu3 docs, image generation):
    visual tokens inside a row, the row-end token after every W of them, then end of frame."""
    H, W = grid
    visual = model.vocabulary_mapping.image_tokens
    eol = model.vocabulary_mapping.eol_token_id

    def fn(batch_id, input_ids):
        offset = input_ids.shape[0] - torch.nonzero(input_ids == WRAPPER, as_tuple=True)[0][0]
        if offset % (W + 1) == 0:
            return [eol]
        if offset > (W + 1) * H:
            return [EOF]
        return visual
    return fn


@torch.no_grad()
def emu3_generate(model, prompt: torch.Tensor, negative: torch.Tensor, grid, guidance: float = 3.0) -> torch.Tensor:
    """Emu3's own greedy image generation (transformers' `generate` as Emu3's docs run it: the
    prefix constraint over visual tokens and row ends, CFG through `negative_prompt_ids` at
    `guidance_scale`) of one prompt -> its visual tokens as codebook ids [H, W], row ends removed
    (the row-end column is checked)."""
    H, W = grid
    ids = prompt[None]
    neg = negative[None]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=H * (W + 1),
                         prefix_allowed_tokens_fn=allowed_tokens(model, grid), do_sample=False, top_k=None,
                         top_p=None, guidance_scale=guidance, negative_prompt_ids=neg,
                         negative_prompt_attention_mask=torch.ones_like(neg), pad_token_id=PAD)
    rows = out[0, ids.shape[1]:].view(H, W + 1)
    assert bool((rows[:, -1] == model.vocabulary_mapping.eol_token_id).all()), "every row ends with the row-end token"
    return model.vocabulary_mapping.convert_bpe2img(rows[None]).long()[0]


def reference_grids(model, prompts: Sequence[torch.Tensor], negatives: Sequence[torch.Tensor], grid,
                    guidance: float = 3.0) -> torch.Tensor:
    return torch.stack([emu3_generate(model, p, n, grid, guidance) for p, n in zip(prompts, negatives)])


def tiny_processor(grid=(4, 4)):
    """An Emu3Processor over the tiny vocabulary (a character-level tokenizer with Emu3's special
    tokens), its default generated size set to `grid` (the processor assumes 8 pixels a token)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import Emu3ImageProcessor, Emu3Processor, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
                              "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"})
    processor = Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=fast)
    H, W = grid
    processor.ratio = f"{W}:{H}"
    processor.image_area = H * W * processor.downsample_ratio ** 2
    return processor
