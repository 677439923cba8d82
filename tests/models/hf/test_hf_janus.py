"""The Janus adapter on tiny random JanusForConditionalGeneration models: `ar` with top_k=1 gives
exactly the tokens of transformers' own `generate(generation_mode="image", do_sample=False,
guidance_scale=...)`, every method runs batched on the wrapped model, and the VQ decodes grids."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import JanusForConditionalGeneration  # noqa: E402

import specdec.decoding as dec  # noqa: E402
from specdec.decoding import Sampling  # noqa: E402
from specdec.models import ARImageModel  # noqa: E402
from specdec.models.family import ModelFamily  # noqa: E402
from specdec.models.hf import wrap  # noqa: E402
from specdec.models.hf.janus import JanusImageModel  # noqa: E402
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402
from janus_models import BOI, BOS, PAD, PROMPTS, V, tiny_janus, tiny_processor  # noqa: E402

def hf_generate(m, ids, scale):
    """transformers' own Janus image generation, greedy, with its sdpa attention."""
    lm_config = m.model.language_model.config
    before = lm_config._attn_implementation
    lm_config._attn_implementation = "sdpa"
    try:
        return m.generate(ids[None], attention_mask=torch.ones_like(ids)[None], generation_mode="image",
                          do_sample=False, guidance_scale=scale)
    finally:
        lm_config._attn_implementation = before




def test_family_shape():
    fam = wrap(tiny_janus())
    assert isinstance(fam, ModelFamily) and isinstance(fam.target, JanusImageModel)
    assert isinstance(fam.target, ARImageModel)
    assert fam.target.grid == (4, 4) and fam.target.vocab_size == V
    cb = fam.codebook
    assert cb.shape == (V, 8)
    torch.testing.assert_close(cb.norm(dim=1), torch.ones(V))
    # the unconditional prompt is Janus's: pads except BOS and the image start
    assert fam.target.unconditional_prompt(PROMPTS[0]).tolist() == [BOS, PAD, PAD, PAD, PAD, BOI]


@pytest.mark.parametrize("scale", [3.0, 5.0])   # Janus's generate needs guidance > 1
def test_ar_greedy_equals_generate(scale):
    m = tiny_janus()
    refs = [hf_generate(m, ids, scale) for ids in PROMPTS]
    fam = wrap(m)
    out = dec.decode("ar", fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=scale, top_k=1), batch_size=2)
    for i, ref in enumerate(refs):
        assert torch.equal(out.tokens[i].reshape(1, -1), ref), (i, out.tokens[i], ref)
    # transformers' generate through the specdec attention (plain calls, its static cache) too
    assert torch.equal(m.generate(PROMPTS[0][None], attention_mask=torch.ones_like(PROMPTS[0])[None],
                                  generation_mode="image", do_sample=False, guidance_scale=scale), refs[0])


def test_images_from_the_vq():
    m = tiny_janus()
    fam = wrap(m)
    out = dec.decode("ar", fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=2.0, top_k=1), batch_size=2)
    assert out.images.shape == (2, 3, 8, 8)
    assert float(out.images.abs().max()) <= 1.0
    # the same pixels as transformers' own decoder
    ref = m.decode_image_tokens(out.tokens.view(2, -1)).permute(0, 3, 1, 2).clamp(-1, 1)
    torch.testing.assert_close(out.images, ref, atol=1e-5, rtol=0)
    # encode maps pixels back to a grid of the VQ's codes
    assert fam.tokenizer.encode(out.images).shape == (2, 4, 4)


@pytest.fixture(scope="module")
def families():
    target = tiny_janus(patches=4, seed=0)
    low = tiny_janus(patches=2, seed=1)
    low.model.vqmodel.load_state_dict(target.model.vqmodel.state_dict())   # MuLo-SD: one shared codebook
    same = tiny_janus(patches=4, seed=2, layers=1)
    fam = wrap(target)
    fam.drafter = wrap(low).target
    fam.sd_drafter = wrap(same).target
    torch.manual_seed(3)
    fam.ssd_heads = SSDHeads(SSDHeadsConfig(dim=fam.target.hidden_dim, grid_width=4, ffn_hidden=16)).eval()
    return fam


OPTIONS = {
    "ar": {}, "sd": dict(chunk=3), "lantern": dict(chunk=3, k=4), "sjd": dict(window=4), "zipar": dict(window=2),
    "mulo": dict(upsample="nearest", k=4), "ssd": dict(rounds=1, chunk=3, commit="write"),
}


@pytest.mark.parametrize("method", list(OPTIONS))
def test_every_method_runs_batched(families, method):
    out = dec.decode(method, families, prompts=PROMPTS, negative_prompts=[None, torch.tensor([BOS, PAD, BOI])],
                     sampling=Sampling(cfg_scale=2.0), batch_size=2, seed=0, **OPTIONS[method])
    assert out.tokens.shape == (2, 4, 4)
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < V
    assert out.images.shape == (2, 3, 8, 8)


def test_mulo_pixel_upsampling(families):
    out = dec.decode("mulo", families, prompts=PROMPTS[:1], sampling=Sampling(cfg_scale=2.0), upsample="pixel", k=4)
    assert out.tokens.shape == (1, 4, 4)


@pytest.mark.parametrize("method", ["ar", "sjd", "mulo", "ssd"])   # token step, padded passes, tree masks, heads
def test_compiled_passes_on_the_wrapped_model_give_the_eager_tokens(families, method):
    """compile=True through the adapter: transformers' decoder layers inside the compiled graphs
    (no graph break: fullgraph), prompts of two lengths in one batch, the same tokens as eager."""
    kw = dict(prompts=PROMPTS, negative_prompts=[None, torch.tensor([BOS, PAD, BOI])],
              sampling=Sampling(cfg_scale=2.0), batch_size=2, seed=4, **OPTIONS[method])
    eager = dec.decode(method, families, **kw)
    compiled = dec.decode(method, families, compile=True, **kw)
    assert compiled.stats.compile_s   # the compiled runners ran
    assert torch.equal(compiled.tokens, eager.tokens)


def test_missing_token_ids_are_named():
    m = tiny_janus()
    m.generation_config.generation_kwargs = {}
    fam = wrap(m)
    with pytest.raises(ValueError, match="boi_token_id"):
        dec.decode("ar", fam, prompts=PROMPTS[:1], sampling=Sampling(cfg_scale=2.0))
    # a negative prompt needs none of them
    dec.decode("ar", fam, prompts=PROMPTS[:1], negative_prompts=[torch.tensor([BOS, PAD, BOI])],
               sampling=Sampling(cfg_scale=2.0, top_k=1))


@pytest.mark.parametrize("chat_template", [False, True])
def test_string_prompts_are_transformers_janus_recipe(chat_template):
    """A string prompt is what transformers' Janus recipe for image generation feeds: the chat
    template over one user message (when the processor has one), then the processor in image
    mode; greedy `ar` on it gives `generate`'s tokens for those ids."""
    processor = tiny_processor(chat_template)
    text = "a red fox"
    if chat_template:
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor(text=text, generation_mode="image", return_tensors="pt")["input_ids"][0]
    assert ids.tolist()[-1] == BOI and (BOS in ids.tolist()) == chat_template
    m = tiny_janus()
    ref = hf_generate(m, ids, 3.0)
    fam = wrap(m, processor)
    assert torch.equal(fam.target.tokenize("a red fox"), ids)
    out = dec.decode("ar", fam, prompts="a red fox", sampling=Sampling(cfg_scale=3.0, top_k=1))
    assert torch.equal(out.tokens[0].reshape(1, -1), ref)


def test_prompt_arguments_of_decode():
    """`prompts` and `negative_prompts` take one prompt or a list of them; anything else is refused
    by name."""
    fam = wrap(tiny_janus(layers=1), tiny_processor())
    kw = dict(sampling=Sampling(cfg_scale=2.0), seed=0)
    one = dec.decode("ar", fam, prompts="ab", negative_prompts="kl", **kw)
    assert torch.equal(one.tokens, dec.decode("ar", fam, prompts=["ab"], negative_prompts=["kl"], **kw).tokens)
    with pytest.raises(ValueError, match="^prompts must be a string, token ids, or a list of them, got int"):
        dec.decode("ar", fam, prompts=5, **kw)
    with pytest.raises(ValueError, match=r"^prompts\[0\] must be a string or non-empty 1-D int token ids"):
        dec.decode("ar", fam, prompts=[["ab", "cd"]], **kw)
    engine = dec.stream("ar", fam, concurrency=1, sampling=Sampling(cfg_scale=2.0))
    with pytest.raises(ValueError, match=r"^negative_prompt must be a string or non-empty 1-D int token ids"):
        engine.submit(prompt="ab", negative_prompt=b"kl")       # (named as submit names it)
    with pytest.raises(ValueError, match=r"^prompt has 70 tokens; .*max_prompt_len=64"):
        dec.stream("ar", wrap(tiny_janus(layers=1), tiny_processor(), max_prompt_len=64), concurrency=1,
                   sampling=Sampling(cfg_scale=2.0)).submit(prompt="a" * 69)


def test_load_pretrained_round_trip(tmp_path):
    from specdec.integrations.transformers import register
    from specdec.models.hf import load_pretrained

    m = tiny_janus()
    m.save_pretrained(tmp_path)
    fam = load_pretrained(str(tmp_path))
    assert isinstance(fam.target, JanusImageModel) and fam.target.bos_token_id == BOS
    sampling = Sampling(cfg_scale=3.0, top_k=1)
    a = dec.decode("ar", fam, prompts=PROMPTS[:1], sampling=sampling).tokens
    b = dec.decode("ar", wrap(m), prompts=PROMPTS[:1], sampling=sampling).tokens
    assert torch.equal(a, b)
    # the per-sub-config form: only the language model on the specdec attention
    register()
    sub = JanusForConditionalGeneration.from_pretrained(tmp_path, attn_implementation={"text_config": "specdec"})
    assert sub.model.language_model.config._attn_implementation == "specdec"
    assert sub.model.vision_model.config._attn_implementation != "specdec"


def test_load_pretrained_errors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.hf import load_pretrained

    with pytest.raises(ValueError, match="save_pretrained"):
        load_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(str(tmp_path))
    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported"):
        load_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match="no adapter"):
        wrap(torch.nn.Linear(2, 2))


def test_grid_option_makes_a_low_resolution_drafter_of_the_same_checkpoint():
    target = tiny_janus(patches=4, seed=0)
    fam = wrap(target)
    fam.drafter = wrap(tiny_janus(patches=4, seed=0), grid=2).target     # same weights, 2x2 grid
    assert fam.drafter.grid == (2, 2) and fam.target.grid == (4, 4)
    out = dec.decode("mulo", fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=2.0), upsample="pixel", k=4)
    assert out.tokens.shape == (2, 4, 4)
    with pytest.raises(ValueError, match=r"grid must be an int >= 1 or \(H, W\)"):
        wrap(target, grid=(2, 0))


@pytest.mark.parametrize("grid", [(2, 8), (8, 2)])
def test_non_square_grid_is_the_same_raster_sequence(grid):
    """Janus's positions are 1-D: an H x W grid of H W = 16 tokens is generate's 16-token sequence
    in H rows (greedy, CFG), decoded by the VQ at H x W; every method runs on it batched."""
    m = tiny_janus(patches=4, seed=0)
    ref = hf_generate(m, PROMPTS[0], 3.0)
    fam = wrap(m, grid=grid)
    assert fam.target.grid == grid
    out = dec.decode("ar", fam, prompts=PROMPTS[:1], sampling=Sampling(cfg_scale=3.0, top_k=1))
    assert torch.equal(out.tokens.reshape(1, -1), ref) and out.images.shape == (1, 3, 2 * grid[0], 2 * grid[1])
    low = wrap(tiny_janus(patches=4, seed=1), grid=(grid[0] // 2, grid[1] // 2)).target
    fam.drafter = low
    torch.manual_seed(0)
    heads = SSDHeads(SSDHeadsConfig(fam.target.hidden_dim, grid[1], n_horizontal=5, n_vertical=1, ffn_hidden=32))
    for method, kw in (("mulo", dict(upsample="nearest", k=4)), ("ssd", dict(heads=heads.eval(), rounds=1)),
                       ("zipar", dict(window=2)), ("sjd", {}), ("sd", dict(heads=heads))):
        got = dec.decode(method, fam, prompts=PROMPTS, sampling=Sampling(cfg_scale=2.0), batch_size=2, **kw)
        assert got.tokens.shape == (2, *grid), method
