"""Emu3 through specdec.models.hf on tiny random Emu3ForConditionalGeneration models
(tests/emu3_models.py): greedy `ar` with CFG equals Emu3's own `generate` (its documented prefix
constraint and negative prompt); one-token decoding equals transformers' own forward over Emu3's
sequence (row-end tokens included); multi-token forwards with holes and tree masks equal feeding
the tokens one by one; every method runs batched and returns codebook grids without row ends; the
VQ decodes frame 0 as Emu3's own `decode_image_tokens` does."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from emu3_models import (BOS, EOF, EOL, VOCAB, generation_prompt, reference_grids, text_ids,  # noqa: E402
                         tiny_emu3, tiny_processor)

from specdec import masks  # noqa: E402
from specdec.decoding import METHODS, Sampling, decode  # noqa: E402
from specdec.models import ARImageModel, hf  # noqa: E402
from specdec.models.conditions import Prompts  # noqa: E402
from specdec.models.hf.emu3 import Emu3ImageModel  # noqa: E402
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402

GRID = (4, 4)
K = 32
ATOL = 5e-5
GREEDY = Sampling(cfg_scale=3.0, top_k=1)


def wrap(hf_model, grid=GRID, **kw):
    return hf.wrap(hf_model, grid=grid, **kw)


def prompts_and_negatives(grid=GRID):
    """Two prompts and two negative prompts, all of different lengths."""
    return ([generation_prompt("abcd", grid), generation_prompt("fedcbaab", grid)],
            [text_ids("kl"), text_ids("hijkl")])


@pytest.fixture(scope="module")
def family():
    """The wrapped tiny Emu3 with what every method needs: a same-grid drafter (sd, lantern), a
    half-grid drafter sharing the codebook (mulo), untrained SSD heads."""
    fam = wrap(tiny_emu3(seed=0))
    fam.sd_drafter = wrap(tiny_emu3(seed=1, vq_seed=0, hidden=16, heads=2, kv_heads=1, layers=1)).target
    fam.drafter = wrap(tiny_emu3(seed=2, vq_seed=0), grid=(GRID[0] // 2, GRID[1] // 2)).target
    torch.manual_seed(0)
    fam.ssd_heads = SSDHeads(SSDHeadsConfig(fam.target.hidden_dim, GRID[1], n_horizontal=5, n_vertical=2,
                                            ffn_hidden=64)).eval()
    return fam


def test_family_shape(family):
    m = family.target
    assert isinstance(m, Emu3ImageModel) and isinstance(m, ARImageModel)
    assert m.grid == GRID and m.vocab_size == K and m.hidden_dim == 32
    assert m.null_class is None and m.supports_cfg
    assert family.codebook.shape == (K, 4)
    torch.testing.assert_close(family.codebook, m.hf_model.model.vqmodel.quantize.embedding.weight)
    # the image head is lm_head's visual-token rows, in codebook order
    ids = torch.tensor([VOCAB[f"<|visual token {c:06d}|>"] for c in range(K)])
    assert torch.equal(m.image_ids, ids)
    h = torch.randn(2, 3, 32)
    torch.testing.assert_close(m.image_logits(h), m.hf_model.lm_head(h)[..., ids], atol=1e-6, rtol=0)
    torch.testing.assert_close(m.embed_tokens(torch.tensor([[0, 5]])),
                               m.hf_model.get_input_embeddings()(ids[[0, 5]])[None])


@pytest.mark.parametrize("grid", [GRID, (3, 5)])
def test_greedy_ar_equals_emu3_generate(grid):
    """`ar` with top_k=1 and CFG 3.0, two images in one batch, prompts and negative prompts of
    different lengths: exactly the codes of Emu3's own greedy generation with the same guidance
    (transformers' generate with negative_prompt_ids and Emu3's prefix constraint)."""
    prompts, negatives = prompts_and_negatives(grid)
    ref = reference_grids(tiny_emu3(seed=0), prompts, negatives, grid, guidance=3.0)
    fam = wrap(tiny_emu3(seed=0), grid=grid)
    out = decode("ar", fam, prompts=prompts, negative_prompts=negatives, sampling=GREEDY, batch_size=2)
    assert out.tokens.shape == (2, *grid)
    assert torch.equal(out.tokens, ref)
    # the same prompts without the generation suffix: the adapter adds it for its grid
    bare = [p[:int((p == VOCAB["<|image start|>"]).nonzero()[-1])] for p in prompts]
    again = decode("ar", fam, prompts=bare, negative_prompts=negatives, sampling=GREEDY, batch_size=2)
    assert torch.equal(again.tokens, ref)


def test_default_negative_prompt_is_bos():
    """Without a processor (no tokenizer for Emu3's negative text) the unconditional prompt is
    BOS alone: the same codes as generate with negative_prompt_ids=[BOS]."""
    prompts, _ = prompts_and_negatives()
    ref = reference_grids(tiny_emu3(seed=0), prompts[:1], [torch.tensor([BOS])], GRID, guidance=3.0)
    out = decode("ar", wrap(tiny_emu3(seed=0)), prompts=prompts[:1], sampling=GREEDY)
    assert torch.equal(out.tokens, ref)
    # a negative prompt given at wrap time
    neg = text_ids("jjk")
    ref = reference_grids(tiny_emu3(seed=0), prompts[:1], [neg], GRID, guidance=3.0)
    out = decode("ar", wrap(tiny_emu3(seed=0), negative_prompt=neg), prompts=prompts[:1], sampling=GREEDY)
    assert torch.equal(out.tokens, ref)


def emu3_sequence(prompt, codes, grid):
    """Emu3's own text sequence of an image: the prompt, each row's visual tokens and a row end."""
    W = grid[1]
    seq = prompt.tolist()
    for u, c in enumerate(codes.tolist()):
        seq.append(VOCAB[f"<|visual token {c:06d}|>"])
        if u % W == W - 1:
            seq.append(EOL)
    return torch.tensor(seq)


def test_one_token_decoding_equals_emu3_forward(family):
    """Feeding a grid one token at a time (CFG rows: prompts and negatives of four lengths)
    gives, at every raster position, the visual-token logits of transformers' own Emu3 forward
    (sdpa, no cache) over Emu3's sequence with its row ends, at the slot predicting that token."""
    m = family.target
    ref_model = copy.deepcopy(m.hf_model)
    ref_model.model.text_model.config._attn_implementation = "sdpa"
    H, W = GRID
    prompts, negatives = prompts_and_negatives()
    codes = torch.randint(0, K, (2, H * W), generator=torch.Generator().manual_seed(3))
    cache = m.new_cache(2, cfg=True)
    with torch.no_grad():
        outs = [m.prefill(cache, Prompts(prompts, negatives)).logits]
        for u in range(H * W - 1):
            outs.append(m.forward_tokens(cache, codes[:, u:u + 1], torch.tensor([u])).logits)
    got = torch.cat(outs, 1)                                                # [4, HW, K]
    rows = [p for cond, neg in zip(prompts, negatives) for p in (m.with_suffix(cond), neg)]   # (the cache's order)
    for r, prompt in enumerate(rows):
        seq = emu3_sequence(prompt, codes[r // 2], GRID)
        with torch.no_grad():
            ref = ref_model(seq[None]).logits[0][:, m.image_ids]
        idx = [len(prompt) - 1] + [len(prompt) + u + u // W + int(u % W == W - 1) for u in range(H * W - 1)]
        torch.testing.assert_close(got[r], ref[idx], atol=ATOL, rtol=0)


def _one_by_one(m, cache, tokens, positions):
    outs = [m.forward_tokens(cache, tokens[:, i:i + 1], positions[:, i:i + 1]).logits for i in range(tokens.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("checked", [True, False])
def test_holes_equal_one_by_one(family, checked):
    """One forward of tokens at positions with holes, different per image and crossing row ends
    (positions 3, 7, 11 end rows), equals feeding them in turn, and leaves the same cache."""
    m = family.target
    prompts, negatives = prompts_and_negatives()
    p = Prompts(prompts, negatives)
    a, b = m.new_cache(2, cfg=True), m.new_cache(2, cfg=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, K, (2, 5), generator=g)
    positions = torch.tensor([[0, 1, 3, 4, 7], [2, 3, 5, 8, 11]])
    with torch.no_grad():
        m.prefill(a, p), m.prefill(b, p)
        got = m.forward_tokens(a, tokens, positions, checked=checked).logits
        ref = _one_by_one(m, b, tokens.repeat_interleave(2, 0), positions.repeat_interleave(2, 0))   # (CFG rows)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        nxt_pos, nxt = torch.tensor([[8], [12]]), torch.randint(0, K, (2, 1), generator=g)
        torch.testing.assert_close(m.forward_tokens(a, nxt, nxt_pos).logits,
                                   m.forward_tokens(b, nxt, nxt_pos).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("checked", [True, False])
def test_tree_equals_feeding_each_branch(family, checked):
    """A draft tree scored with write=False, branches crossing the row end after position 3:
    node i's output equals feeding its root-to-node path one token at a time on a copy of the
    cache; the cache is untouched."""
    m = family.target
    prompts, negatives = prompts_and_negatives()
    cache = m.new_cache(1, cfg=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        m.prefill(cache, Prompts(prompts[1:], negatives[1:]))
        m.forward_tokens(cache, torch.randint(0, K, (1, 2), generator=g), torch.tensor([0, 1]))
        parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 4]])                   # positions 2, 3, 3, 4, 4, 5, 5
        tree = masks.tree_from_parents(parents)
        positions = 2 + tree.depth
        tokens = torch.randint(0, K, (1, 7), generator=g)
        before = cache.valid.clone()
        got = m.forward_tokens(cache, tokens, positions, tree_mask=tree.tree_mask, write=False, checked=checked).logits
        assert torch.equal(cache.valid, before)
        for i in range(7):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(parents[0, j])
            path = path[::-1]
            ref = _one_by_one(m, cache.clone(), torch.cat([tokens[:, path]] * 2), torch.cat([positions[:, path]] * 2))
            torch.testing.assert_close(got[:, i], ref[:, -1], atol=ATOL, rtol=0)


OPTIONS = {
    "ar": [{}],
    "sd": [dict(chunk=3), dict(chunk=3, heads="ssd")],
    "lantern": [dict(chunk=3, k=8, delta=0.2), dict(chunk=3, k=8, heads="ssd")],
    "sjd": [dict(window=6)],
    "zipar": [dict(window=2)],
    "mulo": [dict(upsample="pixel", tau=0.05, k=8), dict(upsample="nearest", resample="raster", k=8)],
    "ssd": [dict(rounds=2, chunk=3, vertical_heads=1), dict(rounds=1, chunk=3, vertical_heads=2, commit="verify")],
}
CASES = [(m, o) for m in METHODS for o in OPTIONS[m]]


@pytest.mark.parametrize("method,options", CASES, ids=[f"{m}-{i}" for m, o in CASES for i in [OPTIONS[m].index(o)]])
def test_every_method_runs_batched(family, method, options):
    """Every method on the wrapped Emu3, two images per batch with CFG: codebook grids (ids in
    [0, V), so never a row-end token) of the right shape, decoded to images of the right shape."""
    options = dict(options)
    if options.get("heads") == "ssd":
        options["heads"] = family.ssd_heads
    prompts, negatives = prompts_and_negatives()
    out = decode(method, family, prompts=prompts, negative_prompts=negatives, seed=0,
                 sampling=Sampling(cfg_scale=3.0, temperature=1.0, top_k=8), batch_size=2, **options)
    H, W = GRID
    assert out.tokens.shape == (2, H, W) and out.tokens.dtype == torch.int64
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < K
    text_ids_of = family.target.image_ids[out.tokens]
    assert not bool((text_ids_of == EOL).any())
    assert out.images.shape == (2, 3, 4 * H, 4 * W)
    assert out.stats.images == 2 and out.stats.target_forwards >= 1


def test_greedy_methods_agree_with_ar(family):
    """Lossless methods under top_k=1 give ar's greedy grid (their verification sees the same
    distributions through the row ends)."""
    prompts, negatives = prompts_and_negatives()
    ref = decode("ar", family, prompts=prompts, negative_prompts=negatives, sampling=GREEDY, batch_size=2).tokens
    for method, options in [("sd", dict(chunk=3)), ("sd", dict(chunk=3, heads=family.ssd_heads)),
                            ("sjd", dict(window=6))]:
        out = decode(method, family, prompts=prompts, negative_prompts=negatives, sampling=GREEDY, batch_size=2,
                     **options)
        assert torch.equal(out.tokens, ref), method


def test_vq_decodes_frame_zero_as_emu3(family):
    """The family's tokenizer decodes a grid as Emu3's own decode_image_tokens does (the BPE
    sequence with its row ends and the three closing tokens), clamped to [-1, 1]; encode gives a
    grid of the same shape back."""
    m = family.target
    H, W = GRID
    codes = torch.randint(0, K, (2, H, W), generator=torch.Generator().manual_seed(4))
    images = family.tokenizer.decode(codes)
    assert images.shape == (2, 3, 4 * H, 4 * W)
    seqs = torch.stack([torch.cat([emu3_sequence(torch.tensor([], dtype=torch.long), c.reshape(-1), GRID),
                                   torch.tensor([EOF, VOCAB["<|image end|>"], 2])]) for c in codes])
    with torch.no_grad():
        ref = m.hf_model.decode_image_tokens(image_tokens=seqs, height=H, width=W)
    torch.testing.assert_close(images, ref.clamp(-1, 1))
    assert family.tokenizer.encode(images).shape == (2, H, W)


def test_prompt_checks(family):
    m = family.target
    with pytest.raises(ValueError, match="asks for a 3x3 grid"):
        m.encode_prompts([generation_prompt("ab", (3, 3))])
    with pytest.raises(ValueError, match="string prompts need a processor"):
        m.encode_prompts(["a cat"])
    # the drafter rewrites the target's size string to its own grid
    assert m.with_suffix(generation_prompt("ab", GRID)).tolist() == generation_prompt("ab", GRID).tolist()
    low = family.drafter.with_suffix(generation_prompt("ab", GRID))
    assert low.tolist() == generation_prompt("ab", (2, 2)).tolist()


def test_wrap_refuses_non_generation_vocabularies():
    hf = tiny_emu3(seed=0)
    hf.config.vocabulary_map = {k: v for k, v in hf.config.vocabulary_map.items() if k != "<|image token|>"}
    with pytest.raises(ValueError, match="image token"):
        wrap(hf)


def test_string_prompts_through_the_processor():
    """With Emu3's processor: the grid is the processor's generated size, string prompts are
    tokenized as `processor(..., return_for_image_generation=True)` does, and the default
    negative prompt is Emu3's documented one, as transformers' Emu3 docs pass it to generate."""
    from specdec.models.hf.emu3 import NEGATIVE_PROMPT

    processor = tiny_processor(GRID)
    texts = ["abcd", "fedcbaab"]
    inputs = processor(text=texts[:1], return_for_image_generation=True)
    assert [list(s) for s in inputs["image_sizes"]] == [list(GRID)]
    prompt = torch.tensor(inputs["input_ids"][0])
    assert torch.equal(prompt, generation_prompt("abcd", GRID))
    neg = torch.tensor(processor(text=[NEGATIVE_PROMPT])["input_ids"][0])
    ref = reference_grids(tiny_emu3(seed=0), [prompt, generation_prompt(texts[1], GRID)], [neg, neg], GRID)
    fam = wrap(tiny_emu3(seed=0), grid=None, processor=processor)
    assert fam.target.grid == GRID
    out = decode("ar", fam, prompts=texts, sampling=GREEDY, batch_size=2)
    assert torch.equal(out.tokens, ref)


def test_a_prompt_too_long_is_named_with_what_the_model_adds():
    """Emu3's default negative prompt (197 characters: 198 tokens here, one per character) counts
    against max_prompt_len: the error names it, not "a prompt"; a prompt's generation suffix is
    named as part of its length."""
    fam = wrap(tiny_emu3(seed=0), grid=None, processor=tiny_processor(GRID), max_prompt_len=64)
    with pytest.raises(ValueError, match=r"^the default negative prompt \(.*NEGATIVE_PROMPT\) \(for prompts\[0\]\) "
                                         r"has 198 tokens; the model was wrapped with max_prompt_len=64"):
        decode("ar", fam, prompts=["ab"], sampling=GREEDY)
    decode("ar", fam, prompts=["ab"], negative_prompts=["kl"], sampling=GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\[1\] has \d+ tokens with the generation suffix"):
        decode("ar", fam, prompts=["ab", "a" * 64], negative_prompts=["kl", "kl"], sampling=GREEDY)


def test_load_pretrained_folder(tmp_path):
    """A save_pretrained folder (model + Emu3Processor) loads through hf.load_pretrained as an
    Emu3 family (grid given: a reloaded Emu3Processor has its class defaults, 90 x 90), and
    decodes what the in-memory model decodes."""
    tiny_emu3(seed=0).save_pretrained(tmp_path)
    tiny_processor(GRID).save_pretrained(tmp_path)
    fam = hf.load_pretrained(str(tmp_path), grid=GRID)
    assert isinstance(fam.target, Emu3ImageModel) and fam.processor is not None and fam.target.grid == GRID
    prompts, negatives = prompts_and_negatives()
    got = decode("ar", fam, prompts=prompts[:1], negative_prompts=negatives[:1], sampling=GREEDY).tokens
    ref = decode("ar", wrap(tiny_emu3(seed=0)), prompts=prompts[:1], negative_prompts=negatives[:1],
                 sampling=GREEDY).tokens
    assert torch.equal(got, ref)
