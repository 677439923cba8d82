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
                   seed: int = 0, scale: float = 1.0, shuffle_seed=None) -> ChameleonForConditionalGeneration:
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


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------

from specdec import decoding  # noqa: E402
from specdec.settings import Sampling  # noqa: E402
from specdec.models.conditions import Prompts  # noqa: E402
from specdec.models.hf import wrap  # noqa: E402
from specdec.models.family import ModelFamily  # noqa: E402
from specdec.models.hf.chameleon import ChameleonImageModel  # noqa: E402
from specdec.models.hf.chameleon_layout import LuminaLayout  # noqa: E402
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402

CODES, GRID = 48, (4, 4)
PROMPTS = [torch.tensor([1, 17, 23, 42]), torch.tensor([1, 99, 7])]       # different lengths


class RecordingDecoder(torch.nn.Module):
    """A stand-in pixel decoder: code c -> a fixed colour, one pixel per token (the tiny VQ
    encoder does not down-sample), so MuLo-SD's pixel up-sampler can round-trip it. Records
    what it was given."""

    def __init__(self, codes: int = CODES):
        super().__init__()
        self.colours = torch.nn.Parameter(torch.randn(codes, 3, generator=torch.Generator().manual_seed(5)),
                                          requires_grad=False)
        self.calls = []

    def forward(self, grid):
        self.calls.append(grid.clone())
        return torch.tanh(self.colours[grid]).permute(0, 3, 1, 2)


def family(seed: int = 0, **kw) -> ModelFamily:
    return wrap(tiny_chameleon(seed=seed, codes=CODES, shuffle_seed=3), grid=GRID, max_prompt_len=16, **kw)


@pytest.mark.parametrize("cfg_scale,negative", [(3.0, None), (1.0, None), (2.0, [torch.tensor([1, 5]), None])])
def test_ar_greedy_equals_lumina_mgpt_greedy_generation(cfg_scale, negative):
    reference_model = tiny_chameleon(shuffle_seed=3)          # the same weights, left on sdpa
    negs = negative or [None, None]
    expected = torch.stack([lumina_greedy(reference_model, p, GRID, cfg_scale, n) for p, n in zip(PROMPTS, negs)])
    fam = family()
    assert isinstance(fam.target, ChameleonImageModel)
    out = decoding.decode("ar", fam, prompts=PROMPTS, negative_prompts=negative,
                          sampling=Sampling(cfg_scale=cfg_scale, top_k=1), batch_size=2)
    assert out.images is None                                  # tokens only without a decoder
    assert torch.equal(out.tokens, expected)


def test_ar_greedy_equals_lumina_mgpt_on_a_non_square_grid():
    """A 2x6 grid (size tokens 8804 + 1 and 8804 + 3, a row end after every 6 tokens): greedy ar
    equals Lumina-mGPT's own greedy generation of that layout."""
    grid = (2, 6)
    expected = torch.stack([lumina_greedy(tiny_chameleon(shuffle_seed=3), p, grid, 3.0) for p in PROMPTS])
    fam = wrap(tiny_chameleon(seed=0, codes=CODES, shuffle_seed=3), grid=grid, max_prompt_len=16)
    out = decoding.decode("ar", fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=3.0, top_k=1), batch_size=2)
    assert out.tokens.shape == (2, *grid) and torch.equal(out.tokens, expected)


def test_prompts_that_already_end_with_the_header_are_not_extended():
    reference_model = tiny_chameleon(shuffle_seed=3)
    expected = lumina_greedy(reference_model, PROMPTS[0], GRID, 3.0)
    fam = family()
    with_header = torch.cat([PROMPTS[0], torch.tensor(fam.target.layout.header)])
    out = decoding.decode("ar", fam, prompts=[with_header], sampling=Sampling(cfg_scale=3.0, top_k=1))
    assert torch.equal(out.tokens[0], expected)


def test_a_prompt_ending_in_another_sizes_header_is_refused():
    """A header for another grid (or a cut one) would get this model's header after it: refused."""
    fam = family()
    start, h, w = fam.target.layout.header
    for tail in ([start, h + 1, w + 1], [start], [start, h]):
        prompt = torch.cat([PROMPTS[0], torch.tensor(tail)])
        with pytest.raises(ValueError, match=r"^prompts\[0\] ends with an image header .* for a 4x4 grid"):
            decoding.decode("ar", fam, prompts=[prompt], sampling=Sampling(cfg_scale=3.0))
        with pytest.raises(ValueError, match=r"^negative_prompts\[0\] ends with an image header"):
            decoding.decode("ar", fam, prompts=PROMPTS[:1], negative_prompts=[prompt], sampling=Sampling(cfg_scale=3.0))


@pytest.fixture(scope="module")
def full_family():
    """Target 4x4 with a recording decoder, MuLo-SD's 2x2 drafter and a same-grid sd drafter
    (both tiny Chameleons on the same vocabulary), untrained SSD heads."""
    decoder = RecordingDecoder()
    drafter = wrap(tiny_chameleon(seed=1, codes=CODES, shuffle_seed=3), grid=(2, 2), max_prompt_len=16)
    sd_drafter = wrap(tiny_chameleon(seed=2, codes=CODES, shuffle_seed=3, dim=16, layers=1), grid=GRID,
                      max_prompt_len=16)
    fam = family(decoder=decoder, drafter=drafter, sd_drafter=sd_drafter)
    torch.manual_seed(0)
    dim = fam.target.hidden_dim
    fam.ssd_heads = SSDHeads(SSDHeadsConfig(dim, GRID[1], n_horizontal=5, n_vertical=1, ffn_hidden=2 * dim)).eval()
    return fam, decoder


RUNS = [("ar", {}), ("sd", {}), ("sd", {"drafter": "heads"}), ("lantern", dict(k=8)),
        ("lantern", dict(k=8, drafter="heads")), ("sjd", dict(window=4)), ("zipar", dict(window=2)),
        ("mulo", dict(upsample="pixel", k=8, tau=0.05)), ("mulo", dict(upsample="nearest", k=8, tau=0.05)),
        ("ssd", dict(rounds=1, commit="write"))]


@pytest.mark.parametrize("method,options", RUNS, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in RUNS])
def test_every_method_runs_batched_and_returns_grids_of_image_codes(full_family, method, options):
    fam, decoder = full_family
    options = dict(options)
    if options.pop("drafter", None) == "heads":
        options["heads"] = fam.ssd_heads
        options["drafter"] = None
    decoder.calls.clear()
    out = decoding.decode(method, fam, prompts=PROMPTS, seed=3, sampling=Sampling(cfg_scale=2.0), batch_size=2,
                          **options)
    assert out.tokens.shape == (2, *GRID) and out.tokens.dtype == torch.int64
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < CODES
    # Grids hold VQ codes: no text id, the row-end token above all, can appear in them.
    assert ROW_END not in fam.target.image_ids[out.tokens].unique().tolist()
    # the user's decoder got the grids (the last call; MuLo-SD's pixel up-sampler calls it too)
    assert torch.equal(decoder.calls[-1], out.tokens)
    assert out.images.shape == (2, 3, *GRID)
    again = decoding.decode(method, fam, prompts=PROMPTS, seed=3, sampling=Sampling(cfg_scale=2.0), batch_size=2,
                            **options)
    assert torch.equal(again.tokens, out.tokens)


def test_row_end_outputs_give_the_next_rows_first_token():
    """The output at a row's last position is the row-end token's: with a different row-end id
    the next row's distribution changes, while the outputs inside a row do not."""
    torch.manual_seed(0)
    tokens = torch.randint(0, CODES, (1, 8))
    outs = []
    for row_end in (ROW_END, ROW_END - 100):
        fam = wrap(tiny_chameleon(shuffle_seed=3), grid=GRID, max_prompt_len=16,
                   layout=LuminaLayout(grid=GRID, row_end=row_end))
        cache = fam.target.new_cache(1)
        with torch.no_grad():
            fam.target.prefill(cache, Prompts([PROMPTS[0]]))
            outs.append(fam.target.forward_tokens(cache, tokens, torch.arange(8)).logits)
    same = [0, 1, 2]                                            # inside row 0
    torch.testing.assert_close(outs[0][:, same], outs[1][:, same])
    assert not torch.allclose(outs[0][:, 3], outs[1][:, 3])     # row 0's end feeds row 1


def test_codebook_choices():
    model = tiny_chameleon(codes=CODES, shuffle_seed=3)
    vq = wrap(model, grid=GRID).codebook
    torch.testing.assert_close(vq, model.model.vqmodel.quantize.embedding.weight.detach())
    emb = wrap(model, grid=GRID, codebook="embeddings").codebook
    ids = image_token_ids(model)
    torch.testing.assert_close(emb, model.get_input_embeddings().weight[ids].detach())
    own = torch.randn(CODES, 5)
    assert wrap(model, grid=GRID, codebook=own).codebook is not None
    assert wrap(model, grid=GRID, codebook=None).codebook is None
    with pytest.raises(ValueError, match="codebook"):
        wrap(model, grid=GRID, codebook=torch.randn(CODES + 1, 5))
    with pytest.raises(ValueError, match="codebook"):
        wrap(model, grid=GRID, codebook="pixels")


def test_lantern_without_a_codebook_is_a_clear_error():
    fam = family(codebook=None, ssd_heads=None)
    with pytest.raises(ValueError, match="codebook"):
        decoding.decode("lantern", fam, prompts=PROMPTS[:1], k=4, sampling=Sampling(cfg_scale=2.0))


def test_bad_layouts_and_vocabularies_are_clear_errors():
    model = tiny_chameleon(codes=CODES)
    with pytest.raises(ValueError, match="size_unit"):
        wrap(model, grid=(3, 4))                               # 3 rows: no Lumina size token says 1.5
    wrap(model, layout=LuminaLayout(grid=(3, 4), size_tokens=(SIZE_BASE + 1, SIZE_BASE + 2)))   # explicit: fine
    with pytest.raises(ValueError, match="row_end"):
        wrap(model, grid=GRID, layout=LuminaLayout(grid=GRID, row_end=VOCAB + 5))
    with pytest.raises(ValueError, match="image tokens"):
        wrap(model, grid=GRID, layout=LuminaLayout(grid=GRID, row_end=FIRST_IMAGE_ID + 1))
    with pytest.raises(ValueError, match="grid"):
        wrap(model, grid=(2, 2), layout=LuminaLayout(grid=GRID))
    with pytest.raises(ValueError, match="image_tokens"):
        wrap(model, grid=GRID, image_tokens=(VOCAB - 2, 10))
    with pytest.raises(ValueError, match="decoder"):
        wrap(model, grid=GRID, decoder="not callable")
    other = wrap(tiny_chameleon(codes=CODES // 2), grid=(2, 2))
    with pytest.raises(ValueError, match="share"):
        wrap(model, grid=GRID, drafter=other)


def test_explicit_image_token_range_equals_the_vocabulary_map():
    """Without a vocabulary map, image_tokens=(4, K) is Chameleon's own layout (code c at id 4 + c)."""
    model = tiny_chameleon(codes=CODES)                        # unshuffled: code c is id 4 + c
    a = decoding.decode("ar", wrap(model, grid=GRID), prompts=PROMPTS[:1], sampling=Sampling(cfg_scale=3.0, top_k=1))
    b = decoding.decode("ar", wrap(model, grid=GRID, image_tokens=(FIRST_IMAGE_ID, CODES)), prompts=PROMPTS[:1],
                        sampling=Sampling(cfg_scale=3.0, top_k=1))
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens[0], lumina_greedy(tiny_chameleon(codes=CODES), PROMPTS[0], GRID, 3.0))


def test_a_bfloat16_model_decodes_valid_grids():
    """Lumina-mGPT runs in bfloat16: the adapter's logits are float32 whatever the weights."""
    fam = wrap(tiny_chameleon(shuffle_seed=3).to(torch.bfloat16), grid=GRID, max_prompt_len=16)
    cache = fam.target.new_cache(2, cfg=True)
    with torch.no_grad():
        first = fam.target.prefill(cache, Prompts(PROMPTS))
    assert first.logits.dtype == torch.float32 and first.logits.shape == (4, 1, CODES)
    out = decoding.decode("sjd", fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=3.0), window=4, batch_size=2)
    assert out.tokens.shape == (2, *GRID) and int(out.tokens.max()) < CODES
