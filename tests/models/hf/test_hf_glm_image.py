"""GLM-Image's token stage through specdec.models.hf on tiny random GlmImageForConditionalGeneration
models (tests/glm_image_models.py): greedy `ar` gives exactly the preview and target tokens of
GLM-Image's own `generate` (with `image_grid_thw`), single and batched with prompts of different
lengths, on grids that are not square and previews that do not divide them; one-token decoding
of both stages equals transformers' own forward over the whole sequence with its M-RoPE
positions; forwards with holes and trees equal feeding the tokens in turn; every method runs
batched; MuLo-SD drafted by the preview keeps the grids' shapes and is, at tau > 1, target
sampling after the preview's draws; string prompts go through the processor (and its chat
template) as GlmImagePipeline gives them."""
import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from glm_image_models import (BOS, EOP, K, SOP, glm_generate, prompt_ids, tail_ids, text_ids,  # noqa: E402
                              tiny_glm_image, tiny_processor)

from specdec import masks  # noqa: E402
from specdec.decoding import METHODS, RunSettings, Sampling, ar, decode, sjd, stages  # noqa: E402
from helpers import ar_grid  # noqa: E402
from specdec.decoding.runner import ModelRunner  # noqa: E402
from specdec.decoding.streams import ImageStreams  # noqa: E402
from specdec.models import ARImageModel, hf  # noqa: E402
from specdec.models.conditions import Prompts  # noqa: E402
from specdec.models.family import ModelFamily  # noqa: E402
from specdec.models.hf.glm_image import (GLM_SAMPLING, GlmImageStage, grids_for, preview_grid_for,  # noqa: E402
                                         prior_token_ids)
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402
from specdec.models.upsampler import TokenUpsampler  # noqa: E402

GRID, PREVIEW = (4, 3), (3, 2)          # a non-square target, a preview that does not divide it
GREEDY = Sampling(top_k=1)
ATOL = 5e-5


def prompts(grid=GRID, preview=PREVIEW):
    """Two prompts of different lengths, as the processor makes them (text, grid tail, bos)."""
    return [prompt_ids("abcd", grid, preview), prompt_ids("fedcbaabkl", grid, preview)]


def wrap(model=None, grid=GRID, preview=PREVIEW, **kw):
    return hf.wrap(model if model is not None else tiny_glm_image(seed=0), grid=grid, preview_grid=preview, **kw)


@pytest.fixture(scope="module")
def family():
    fam = wrap()
    torch.manual_seed(0)
    fam.ssd_heads = SSDHeads(SSDHeadsConfig(fam.target.hidden_dim, GRID[1], n_horizontal=5, n_vertical=2,
                                            ffn_hidden=64)).eval()
    return fam


def test_family_shape(family):
    t, p = family.target, family.preview
    assert isinstance(t, GlmImageStage) and isinstance(p, GlmImageStage)
    assert isinstance(t, ARImageModel) and isinstance(p, ARImageModel)
    assert (t.stage, t.grid, p.stage, p.grid) == ("target", GRID, "preview", PREVIEW)
    assert t.vocab_size == p.vocab_size == K and t.hidden_dim == 64 and not t.supports_cfg
    assert family.sampling == GLM_SAMPLING == Sampling(temperature=0.9, top_p=0.75)
    assert family.tokenizer is None and t.hf_model is p.hf_model
    vq = t.hf_model.model.vqmodel.quantize.embedding.weight
    torch.testing.assert_close(family.codebook, F.normalize(vq, dim=-1))
    # the head is lm_head's first K rows (the codes); a code's input embedding is its own id's
    h = torch.randn(2, 3, 64)
    torch.testing.assert_close(t.image_logits(h), t.hf_model.lm_head(h)[..., :K], atol=1e-6, rtol=0)
    torch.testing.assert_close(t.embed_tokens(torch.tensor([[0, 5]])),
                               t.hf_model.get_input_embeddings()(torch.tensor([[0, 5]])))


@pytest.mark.parametrize("height, width", [(1152, 768), (1024, 1024), (2048, 2048), (768, 1344), (1000, 700),
                                           (512, 1536), (128, 96)])
def test_grids_follow_the_processor(height, width):
    """The target grid (pixels / 32, floored) and the preview, by GlmImageProcessor's own rule."""
    processor = tiny_processor()
    H, W, h, w = processor._get_target_shape(height=height, width=width)
    assert grids_for(height, width) == ((H, W), (h, w))
    assert preview_grid_for((H, W)) == (h, w)
    assert grids_for(1152, 768) == ((36, 24), (19, 13)) and grids_for(1024, 1024) == ((32, 32), (16, 16))


@pytest.mark.parametrize("grid, preview", [(GRID, PREVIEW), ((2, 5), (3, 2)), ((4, 4), (2, 2))])
def test_greedy_ar_equals_glm_image_generate(grid, preview):
    """`ar` with top_k=1, two prompts of different lengths in one batch and each alone: exactly
    the preview and target codes of GLM-Image's own greedy generation (image_grid_thw, left
    padding), the ids past the codes suppressed there as the adapter's head cuts them."""
    ps = prompts(grid, preview)
    ref_preview, ref = glm_generate(tiny_glm_image(seed=0), ps, grid, preview)
    assert ref.unique().numel() > 3                                   # not a constant grid
    fam = wrap(grid=grid, preview=preview)
    out = decode("ar", fam, prompts=ps, sampling=GREEDY, batch_size=2)
    assert out.tokens.shape == (2, *grid) and out.preview.shape == (2, *preview)
    assert torch.equal(out.preview, ref_preview) and torch.equal(out.tokens, ref)
    for i in range(2):
        one = decode("ar", fam, prompts=ps[i:i + 1], sampling=GREEDY)
        assert torch.equal(one.preview, ref_preview[i:i + 1]) and torch.equal(one.tokens, ref[i:i + 1])
    hw, HW = preview[0] * preview[1], grid[0] * grid[1]
    assert out.stats.target_forwards == 2 * (hw + HW) and out.stats.tokens == 2 * (hw + HW)
    assert out.stats.preview_passes == [hw, hw]


@pytest.mark.parametrize("method, options", [("ar", {}), ("sjd", dict(window=3))])
def test_a_two_stage_decode_reports_its_tokens_fed(family, method, options):
    """The statistics of a two-stage decode hold both stages' counts: tokens fed (every image
    token fed to the model) and target passes per image are the preview stage's plus the target
    stage's, each stage decoded on its own; MuLo-SD drafted by the preview counts the preview's
    tokens fed too."""
    ps = prompts()
    out = decode(method, family, prompts=ps, seed=5, batch_size=2, **options)
    run = RunSettings(seed=5, batch_size=2, sampling=GLM_SAMPLING)
    first = ar.decode(family.preview, Prompts(ps), run=run)
    module = {"ar": ar, "sjd": sjd}[method]
    second = module.decode(family.target, family.target.condition_on_preview(Prompts(ps), first.tokens),
                           options=module.OPTIONS(**options), run=stages.target_stage_run(run))
    assert torch.equal(out.preview, first.tokens) and torch.equal(out.tokens, second.tokens)
    assert first.stats.target_tokens_fed > 0 and second.stats.target_tokens_fed > 0
    assert out.stats.tokens_fed == [a + b for a, b in zip(first.stats.tokens_fed, second.stats.tokens_fed)]
    assert out.stats.target_passes == [a + b for a, b in zip(first.stats.target_passes, second.stats.target_passes)]
    assert out.stats.preview_passes == first.stats.target_passes
    drafted = decode("mulo", family, prompts=ps, seed=5, batch_size=2, k=8)
    assert torch.equal(drafted.preview, first.tokens)
    assert min(d - p for d, p in zip(drafted.stats.tokens_fed, first.stats.tokens_fed)) > 0


def transformers_logits(model, prompt, preview, target, grid, preview_grid):
    """transformers' own forward (sdpa, no cache) over GLM-Image's whole sequence (prompt,
    preview, target) at the M-RoPE positions its generate uses (get_rope_index's prefill
    positions, then its cached decode positions) -> code logits of every output [n, K]."""
    seq = torch.cat([prompt, preview.reshape(-1), target.reshape(-1)])[None]
    thw = torch.tensor([[1, *grid], [1, *preview_grid]])
    pos, _ = model.model.get_rope_index(prompt[None], image_grid_thw=thw)
    decode_pos = model.model._cached_decode_position_ids[0]             # [3, hw + HW + 1]
    n_new = seq.shape[1] - prompt.numel()
    position_ids = torch.cat([pos, decode_pos[:, None, :n_new]], dim=2)
    with torch.no_grad():
        return model(input_ids=seq, position_ids=position_ids).logits[0, :, :K]


def test_one_token_decoding_equals_transformers_forward(family):
    """Both stages fed one token at a time (two prompts of different lengths, one batch): the
    preview stage's outputs, then the target stage's (its prefix the prompt and the preview),
    equal transformers' forward over the whole sequence at its own M-RoPE positions."""
    ref_model = copy.deepcopy(family.target.hf_model)
    ref_model.model.language_model.config._attn_implementation = "sdpa"
    (H, W), (h, w) = GRID, PREVIEW
    ps = prompts()
    g = torch.Generator().manual_seed(3)
    low, high = torch.randint(0, K, (2, h * w), generator=g), torch.randint(0, K, (2, H * W), generator=g)
    pv, tg = family.preview, family.target
    with torch.no_grad():
        cache = pv.new_cache(2)
        outs = [pv.prefill(cache, Prompts(ps)).logits]
        for u in range(h * w - 1):
            outs.append(pv.forward_tokens(cache, low[:, u:u + 1], torch.tensor([u])).logits)
        cache = tg.new_cache(2)
        outs.append(tg.prefill(cache, tg.condition_on_preview(Prompts(ps), low.view(2, h, w))).logits)
        for u in range(H * W - 1):
            outs.append(tg.forward_tokens(cache, high[:, u:u + 1], torch.tensor([u])).logits)
    got = torch.cat(outs, 1)                                            # [2, hw + HW, K]
    for r, prompt in enumerate(ps):
        ref = transformers_logits(ref_model, prompt, low[r].view(h, w), high[r].view(H, W), GRID, PREVIEW)
        L = prompt.numel()
        torch.testing.assert_close(got[r], ref[L - 1:L - 1 + h * w + H * W], atol=2e-4, rtol=0)


def _one_by_one(m, cache, tokens, positions):
    return torch.cat([m.forward_tokens(cache, tokens[:, i:i + 1], positions[:, i:i + 1]).logits
                      for i in range(tokens.shape[1])], 1)


def _target_cache(family, n=2):
    tg = family.target
    low = torch.randint(0, K, (n, *PREVIEW), generator=torch.Generator().manual_seed(5))
    cache = tg.new_cache(n)
    tg.prefill(cache, tg.condition_on_preview(Prompts(prompts()[:n]), low))
    return cache


@pytest.mark.parametrize("checked", [True, False])
def test_holes_and_islands_equal_one_by_one(family, checked):
    """One forward at positions with holes (islands of a MuLo-SD resampling), different per image,
    equals feeding the tokens in turn: the M-RoPE positions come from the slots alone."""
    tg = family.target
    with torch.no_grad():
        a, b = _target_cache(family), _target_cache(family)
        tokens = torch.randint(0, K, (2, 5), generator=torch.Generator().manual_seed(1))
        positions = torch.tensor([[0, 1, 3, 4, 7], [2, 3, 5, 8, 11]])
        got = tg.forward_tokens(a, tokens, positions, checked=checked).logits
        torch.testing.assert_close(got, _one_by_one(tg, b, tokens, positions), atol=ATOL, rtol=0)
        nxt, pos = torch.randint(0, K, (2, 1)), torch.tensor([[8], [9]])
        torch.testing.assert_close(tg.forward_tokens(a, nxt, pos).logits, tg.forward_tokens(b, nxt, pos).logits,
                                   atol=ATOL, rtol=0)


def test_tree_equals_feeding_each_branch(family):
    """A draft tree scored with write=False: node i's output equals feeding its root-to-node path
    on a copy of the cache; the cache is untouched."""
    tg = family.target
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        cache = _target_cache(family, 1)
        tg.forward_tokens(cache, torch.randint(0, K, (1, 2), generator=g), torch.tensor([0, 1]))
        parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 4]])
        tree = masks.tree_from_parents(parents)
        positions = 2 + tree.depth
        tokens = torch.randint(0, K, (1, 7), generator=g)
        before = cache.valid.clone()
        got = tg.forward_tokens(cache, tokens, positions, tree_mask=tree.tree_mask, write=False).logits
        assert torch.equal(cache.valid, before)
        for i in range(7):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(parents[0, j])
            path = path[::-1]
            ref = _one_by_one(tg, cache.clone(), tokens[:, path], positions[:, path])
            torch.testing.assert_close(got[:, i], ref[:, -1], atol=ATOL, rtol=0)


OPTIONS = {
    "ar": [{}],
    "sd": [dict(chunk=3, heads="ssd")],
    "lantern": [dict(chunk=3, k=8, delta=0.2, heads="ssd")],
    "sjd": [dict(window=4)],
    "zipar": [dict(window=2)],
    "mulo": [dict(tau=0.05, k=8), dict(upsample="nearest", resample="raster", k=8, drafting="zipar", window=1)],
    "ssd": [dict(rounds=2, chunk=3, vertical_heads=1), dict(rounds=1, chunk=3, vertical_heads=2, commit="verify")],
}
CASES = [(m, o) for m in METHODS for o in OPTIONS[m]]


@pytest.mark.parametrize("method,options", CASES, ids=[f"{m}-{i}" for m, o in CASES for i in [OPTIONS[m].index(o)]])
def test_every_method_runs_batched(family, method, options):
    """Every method on the target stage (the preview by ar, or drafted by mulo itself), two
    images per batch with GLM-Image's sampling: codes of the right shapes, no image tokens past
    the codes, the preview returned."""
    options = dict(options)
    if options.get("heads") == "ssd":
        options["heads"] = family.ssd_heads
    out = decode(method, family, prompts=prompts(), seed=0, batch_size=2, **options)
    assert out.tokens.shape == (2, *GRID) and out.preview.shape == (2, *PREVIEW)
    assert out.tokens.dtype == torch.int64 and int(out.tokens.max()) < K and int(out.preview.max()) < K
    assert out.images is None and out.stats.images == 2 and out.stats.target_forwards >= 2


@pytest.mark.parametrize("preview_method, preview_options", [("sjd", dict(window=3)), ("zipar", dict(window=1)),
                                                             ("ssd", "heads")])
def test_the_preview_stage_takes_any_method(family, preview_method, preview_options):
    """The preview grid is an ARImageModel grid too: sjd, zipar, or SSD with heads of its width."""
    if preview_options == "heads":
        torch.manual_seed(1)
        preview_options = dict(heads=SSDHeads(SSDHeadsConfig(64, PREVIEW[1], n_horizontal=5, n_vertical=1,
                                                             ffn_hidden=64)).eval(), rounds=1, vertical_heads=1)
    out = decode("ar", family, prompts=prompts(), seed=0, batch_size=2, preview_method=preview_method,
                 preview_options=preview_options)
    assert out.tokens.shape == (2, *GRID) and out.preview.shape == (2, *PREVIEW)
    # greedy: the lossless ones give ar's preview
    if preview_method == "sjd":
        ref = decode("ar", family, prompts=prompts(), sampling=GREEDY, batch_size=2)
        got = decode("ar", family, prompts=prompts(), sampling=GREEDY, batch_size=2, preview_method="sjd",
                     preview_options=dict(window=3))
        assert torch.equal(got.preview, ref.preview) and torch.equal(got.tokens, ref.tokens)


def test_mulo_drafted_by_the_preview(family):
    """MuLo-SD with the preview as its draft (the default on this family, which has no drafter):
    tau = 0 keeps the up-sampled preview whole (token-space nearest 3x2 -> 4x3) after one
    verification pass; tau > 1 resamples every position in raster order: plain AR of the target
    stage continuing the image's stream after the preview's draws; greedy, that is GLM-Image's
    own generation."""
    ps = prompts()
    (H, W), (h, w) = GRID, PREVIEW
    keep = decode("mulo", family, prompts=ps, seed=4, tau=0.0, batch_size=2)
    ref = F.interpolate(keep.preview[:, None].float(), size=GRID, mode="nearest")[:, 0].long()
    assert torch.equal(keep.tokens, ref)
    assert keep.stats.target_forwards_per_image == h * w + 2 and keep.stats.draft_forwards == 0
    assert keep.stats.preview_passes == [h * w] * 2 and keep.stats.tokens == 2 * (h * w + H * W)
    every = decode("mulo", family, prompts=ps[1:], seed=4, tau=1.5, resample="raster")
    gen = ImageStreams(4, [0])                                # image 0's stream, as decode's
    preview = ar_grid(ModelRunner(family.preview, GLM_SAMPLING), Prompts(ps[1:]), gen).view(1, h, w)
    target = ar_grid(ModelRunner(family.target, GLM_SAMPLING),
                         family.target.condition_on_preview(Prompts(ps[1:]), preview), gen)
    assert torch.equal(every.preview, preview) and torch.equal(every.tokens.view(1, -1), target)
    greedy = decode("mulo", family, prompts=ps, tau=1.5, sampling=GREEDY, batch_size=2)
    ref_preview, ref = glm_generate(tiny_glm_image(seed=0), ps, GRID, PREVIEW)
    assert torch.equal(greedy.preview, ref_preview) and torch.equal(greedy.tokens, ref)


def test_mulo_with_the_learned_upsampler_where_the_ratio_is_an_integer():
    """A 4x6 target with a 2x3 preview (r = 2): the family's learned up-sampler is MuLo-SD's
    default there; at a ratio it cannot serve (3x2 -> 4x3) the default falls back to nearest."""
    fam = wrap(grid=(4, 6), preview=(2, 3))
    torch.manual_seed(0)
    fam.upsampler = TokenUpsampler(K, fam.codebook.shape[1], factor=2, channels=8).eval()
    with torch.no_grad():
        fam.upsampler.codebook.copy_(fam.codebook)
    out = decode("mulo", fam, prompts=prompts((4, 6), (2, 3)), seed=1, tau=0.0, batch_size=2)
    assert torch.equal(out.tokens, fam.upsampler.upsample(out.preview))
    other = wrap()
    other.upsampler = fam.upsampler
    assert decode("mulo", other, prompts=prompts(), seed=1, k=8).tokens.shape == (2, *GRID)
    with pytest.raises(ValueError, match="does not divide"):
        decode("mulo", other, prompts=prompts(), upsample="learned")


def test_string_prompts_through_the_processor():
    """With GLM-Image's processor (a 128 x 96 image: a 4x3 target and, by its rule, an 18x13
    preview): strings become the processor's ids, chat template or not, and greedy ar equals
    generate on those ids; token ids without the tail get it appended; a tail naming another
    size is refused."""
    processor = tiny_processor()
    fam = hf.wrap(tiny_glm_image(seed=0), processor, height=128, width=96)
    grid, preview = fam.target.grid, fam.preview.grid
    assert (grid, preview) == ((4, 3), (18, 13))
    ids = processor(text=["abc"], target_h=128, target_w=96, return_tensors="pt")["input_ids"][0]
    assert torch.equal(ids, prompt_ids("abc", grid, preview))
    for p in ("abc", text_ids("abc"), ids):
        assert torch.equal(fam.preview.encode_prompts([p]).cond[0], ids)
    ref_preview, ref = glm_generate(tiny_glm_image(seed=0), [ids], grid, preview)
    out = decode("ar", fam, prompts=["abc"], sampling=GREEDY)
    assert torch.equal(out.preview, ref_preview) and torch.equal(out.tokens, ref)
    with pytest.raises(ValueError, match="grid tail names another size"):
        fam.preview.encode_prompts([prompt_ids("abc", (4, 4), (16, 16))])
    chat = tiny_processor(chat_template=True)
    wrapped = hf.wrap(tiny_glm_image(seed=0), chat, height=128, width=96)
    got = wrapped.preview.encode_prompts(["abc"]).cond[0]
    assert torch.equal(got,
                       torch.cat([torch.tensor([SOP]), text_ids("abc"), torch.tensor([EOP]), tail_ids(grid, preview)]))


def test_prior_token_ids_are_the_pipelines_2x_nearest():
    grids = torch.randint(0, K, (2, 3, 5))
    prior = prior_token_ids(grids)
    ref = F.interpolate(grids[:, None].float(), scale_factor=2, mode="nearest").long().view(2, -1)
    assert prior.shape == (2, 4 * 15) and torch.equal(prior, ref)


def test_refusals(family):
    ps = prompts()
    with pytest.raises(ValueError, match="^cfg_scale != 1 needs classifier-free guidance, which .* does not have"):
        decode("ar", family, prompts=ps, sampling=Sampling(cfg_scale=2.0))
    small = wrap(grid=(2, 5), preview=(3, 2))       # (the preview drafts: it must be no larger)
    with pytest.raises(ValueError, match=r"^preview grid \(3, 2\) is larger than the target grid \(2, 5\)"):
        decode("mulo", small, prompts=prompts((2, 5), (3, 2)), sampling=GREEDY)
    with pytest.raises(ValueError, match="no classifier-free guidance"):
        family.target.new_cache(1, cfg=True)
    with pytest.raises(ValueError, match="no negative prompts"):
        decode("ar", family, prompts=ps, negative_prompts=ps)
    with pytest.raises(ValueError, match="must end with GLM-Image's grid tail"):
        decode("ar", family, prompts=[text_ids("abc")])
    with pytest.raises(ValueError, match="prompts followed by their preview grids"):
        decode("ar", ModelFamily(target=family.target), prompts=ps, sampling=GREEDY)
    with pytest.raises(ValueError, match="preview must be"):
        family.target.condition_on_preview(Prompts(ps), torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="preview_method"):
        decode("ar", ModelFamily(target=family.target), prompts=ps, sampling=GREEDY, preview_method="sjd")
    with pytest.raises(ValueError, match="height and width .* or as grid"):
        hf.wrap(tiny_glm_image(seed=0), height=128, width=96, grid=(4, 3))
    assert int(ps[0][-1]) == BOS


def test_load_pretrained_folder(tmp_path):
    """A save_pretrained folder (model + processor) loads as a GLM-Image family at the size given,
    and decodes what the in-memory model decodes."""
    tiny_glm_image(seed=0).save_pretrained(tmp_path)
    tiny_processor().save_pretrained(tmp_path)
    fam = hf.load_pretrained(str(tmp_path), height=128, width=96)
    assert fam.target.grid == (4, 3) and fam.preview.grid == (18, 13) and fam.processor is not None
    fam = hf.load_pretrained(str(tmp_path), grid=GRID, preview_grid=PREVIEW)
    got = decode("ar", fam, prompts=["ab"], sampling=GREEDY)
    ref = decode("ar", hf.wrap(tiny_glm_image(seed=0), tiny_processor(), grid=GRID, preview_grid=PREVIEW),
                 prompts=["ab"], sampling=GREEDY)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.preview, ref.preview)


def test_compiled_passes_give_the_eager_tokens(family):
    """compile=True on both stages (GLM-Image's decoder layers and the M-RoPE positions inside the
    compiled graphs, fullgraph): the same preview and target as eager, prompts of two lengths in
    one batch (what benchmarks/decoders/record_real_size.py --compile runs on a GPU)."""
    kw = dict(prompts=prompts(), seed=3, batch_size=2)
    eager = decode("ar", family, **kw)
    compiled = decode("ar", family, compile=True, **kw)
    assert len(compiled.stats.compile_s) == 2 and not eager.stats.compile_s   # one batch of each stage
    assert torch.equal(compiled.preview, eager.preview) and torch.equal(compiled.tokens, eager.tokens)
