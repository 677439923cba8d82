"""specdec.models.hf on transformers' ChameleonForConditionalGeneration, laid out as Lumina-mGPT
generates images: prompt, image-start 8197, the two grid-size tokens 8804 + H/2 and 8804 + W/2,
then H rows of W image tokens each followed by the row-end token 8803, then image-end 8196.

Tiny random Chameleons are built here (no weights). The truth is `lumina_greedy`: Lumina-mGPT's
greedy generation loop written with plain transformers calls (full-sequence forwards, no cache),
which the adapter's `ar` with top_k=1 must reproduce token for token."""
from __future__ import annotations

import pytest
import torch

from decoding_models import single_thread  # noqa: F401  (autouse fixture)

transformers = pytest.importorskip("transformers")
from transformers import ChameleonConfig, ChameleonForConditionalGeneration  # noqa: E402

# Lumina-mGPT's special tokens (Chameleon's vocabulary): <racm3:break>, <eoss>, <reserved08799>,
# and the grid-size tokens <reserved08800 + n>.
IMAGE_START, IMAGE_END, ROW_END, SIZE_BASE = 8197, 8196, 8803, 8804
FIRST_IMAGE_ID = 4          # Chameleon's image tokens are ids 4.. (VQ code c is id 4 + c)
VOCAB = 8832                # holds every special id above for grids up to 56 x 56


def _code_name(code: int) -> str:
    """Chameleon's BPE name of VQ code `code`: IMGIMG + its decimal digits as letters A-J + Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def vocabulary_map(codes: int, *, shuffle_seed=None) -> dict:
    """A Chameleon vocabulary map with `codes` image tokens at ids 4 .. 4 + codes - 1 (code c at
    id 4 + c, as in Chameleon; with `shuffle_seed` the codes are assigned to those ids in a random
    order, so that a wrong id <-> code mapping cannot go unnoticed) and Lumina-mGPT's special
    tokens."""
    order = list(range(codes))
    if shuffle_seed is not None:
        order = torch.randperm(codes, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    vmap = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<image>": 8711,
            "<racm3:break>": IMAGE_START, "<eoss>": IMAGE_END, "<reserved08799>": ROW_END}
    for n in range(VOCAB - SIZE_BASE):
        vmap[f"<reserved{8800 + n:05d}>"] = SIZE_BASE + n
    for i, code in enumerate(order):
        vmap[_code_name(code)] = FIRST_IMAGE_ID + i
    return vmap


def tiny_chameleon(*, codes: int = 48, dim: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 2,
                   seed: int = 0, scale: float = 0.3, shuffle_seed=None) -> ChameleonForConditionalGeneration:
    """A random Chameleon with a vocabulary holding `codes` image tokens and Lumina-mGPT's special
    ids, its VQ reduced to a few channels (only its codebook is used here). Weights ~ N(0, scale)
    so that the logits are far from uniform (greedy decoding is then free of near-ties)."""
    config = ChameleonConfig(
        vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        vocabulary_map=vocabulary_map(codes, shuffle_seed=shuffle_seed),
        vq_config=dict(embed_dim=8, num_embeddings=codes, latent_channels=8, resolution=16,
                       base_channels=32, channel_multiplier=[1], num_res_blocks=1),
        attn_implementation="sdpa")
    model = ChameleonForConditionalGeneration(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * scale)
    return model.eval()


def image_token_ids(model) -> torch.Tensor:
    """BPE id of each VQ code, in code order (from the model's own vocabulary mapping)."""
    img2bpe = model.model.vocabulary_mapping.img2bpe
    return torch.tensor([img2bpe[c] for c in range(len(img2bpe))])


@torch.no_grad()
def lumina_greedy(model, prompt: torch.Tensor, grid, cfg_scale: float, negative=None) -> torch.Tensor:
    """Lumina-mGPT's greedy text-to-image generation, with plain transformers calls.

    The conditional sequence is `prompt + [image-start, size(H), size(W)]`; the unconditional one is
    `negative + [image-start, size(H), size(W)]` (Lumina-mGPT's default unconditional context starts
    at the image-start token: negative=None is the empty prompt). Every step runs the whole
    sequence through `model.model` (sdpa attention, no cache) and takes the logits of the last
    position from `model.lm_head`: `model(...)` itself would set every image token's logit to the
    dtype's minimum (ChameleonForConditionalGeneration.forward disallows image tokens in text
    generation). Guidance is Lumina-mGPT's: uncond + s * (cond - uncond) on the raw logits; the
    candidates are restricted to the image tokens; after the W-th token of a row the row-end token
    is forced (fed to both sequences). Returns the [H, W] grid of VQ codes."""
    H, W = grid
    ids = image_token_ids(model)
    header = torch.tensor([IMAGE_START, SIZE_BASE + H // 2, SIZE_BASE + W // 2])
    cond = torch.cat([prompt.long(), header])[None]
    uncond = (header if negative is None else torch.cat([negative.long(), header]))[None]

    def last_logits(seq):
        return model.lm_head(model.model(input_ids=seq).last_hidden_state[:, -1]).float()

    codes = []
    for _ in range(H):
        for _ in range(W):
            c = last_logits(cond)
            logits = c if cfg_scale == 1.0 else (lambda u: u + cfg_scale * (c - u))(last_logits(uncond))
            code = int(logits[0, ids].argmax())           # restricted to the image tokens
            codes.append(code)
            step = ids[code].view(1, 1)
            cond, uncond = torch.cat([cond, step], 1), torch.cat([uncond, step], 1)
        row_end = torch.tensor([[ROW_END]])
        cond, uncond = torch.cat([cond, row_end], 1), torch.cat([uncond, row_end], 1)
    return torch.tensor(codes).view(H, W)


# ------------------------------------------------------------------------------------------------
# the reference's premises, checked on the library itself
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_chameleon_forward_masks_image_tokens_so_the_lm_head_must_be_read_directly():
    model = tiny_chameleon()
    seq = torch.tensor([[1, 5, 9, IMAGE_START, SIZE_BASE + 2, SIZE_BASE + 2]])
    masked = model(input_ids=seq).logits[0, -1]
    ids = image_token_ids(model)
    assert bool((masked[ids] == torch.finfo(masked.dtype).min).all())
    direct = model.lm_head(model.model(input_ids=seq).last_hidden_state)[0, -1]
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[ids] = False
    torch.testing.assert_close(direct[others], masked[others])
    assert bool(torch.isfinite(direct[ids]).all()) and float(direct[ids].std()) > 0.1


def test_the_vocabulary_maps_each_vq_code_to_one_image_token():
    model = tiny_chameleon(codes=48, shuffle_seed=3)
    ids = image_token_ids(model)
    assert sorted(ids.tolist()) == list(range(FIRST_IMAGE_ID, FIRST_IMAGE_ID + 48))
    assert ids.tolist() != sorted(ids.tolist())          # shuffled: code c is not id 4 + c
    assert ROW_END not in ids.tolist() and IMAGE_START not in ids.tolist()


def test_reference_loop_uses_the_guidance_and_the_prompt():
    model = tiny_chameleon()
    prompt = torch.tensor([1, 17, 23, 42])
    plain = lumina_greedy(model, prompt, (4, 4), 1.0)
    guided = lumina_greedy(model, prompt, (4, 4), 3.0)
    other = lumina_greedy(model, torch.tensor([1, 99, 7]), (4, 4), 3.0)
    assert plain.shape == (4, 4) and int(plain.min()) >= 0 and int(plain.max()) < 48
    assert not torch.equal(plain, guided) and not torch.equal(guided, other)
