"""LlamaGen text-to-image on tiny random models: checkpoints with upstream's key names load; the
caption prefix (left padding, the unconditional rows) follows an independent transcription of
LlamaGen's t2i sampling (sample_t2i.py + generate.py); `ar` with top_k=1 gives the tokens of a
full-sequence greedy loop over the uncached SDPA forward with the same guidance (cfg_interval and
the cfg_scale > 1 rule included); every method decodes batched prompts of different lengths."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import ar_grid
from decoding_models import TinyFamily, tiny_gpt, tiny_heads, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding.runner import ModelRunner
from specdec.settings import Sampling
from specdec.models import CheckpointMismatchError, Prompts, llamagen_manifest, load_llamagen
from specdec.models.protocol import join_cfg, split_cfg
from specdec.numerics import batch_invariant
from specdec.profiling import count_host_syncs
from llamagen_models import CAPTION_DIM, GRID, SLOTS, TINY, VOCAB, captions, t5_style, tiny_t2i, upstream_t2i_state

def test_t2i_manifest_has_upstream_caption_embedder():
    m = llamagen_manifest("GPT-XL", model_type="t2i")
    assert m["cls_embedding.cap_proj.fc1.weight"] == (1280, 2048)   # caption_dim 2048 -> dim
    assert m["cls_embedding.cap_proj.fc2.weight"] == (1280, 1280)
    assert m["cls_embedding.uncond_embedding"] == (120, 2048)       # 120 caption slots
    assert "cls_embedding.embedding_table.weight" not in m
    assert round(sum(math.prod(s) for s in m.values()) / 1e6) == 778  # XL's 775M with the caption MLP


@pytest.mark.parametrize("fmt", ["model", "safetensors"])
def test_t2i_checkpoint_with_upstream_keys_loads(tmp_path, fmt):
    state = upstream_t2i_state()
    extras = dict(state, freqs_cis=torch.zeros(SLOTS + GRID * GRID, 8, 2))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "t2i.safetensors"
        save_file(extras, str(path))
    else:
        path = tmp_path / "t2i.pt"
        torch.save({"model": extras}, str(path))
    model = load_llamagen(str(path), TINY, grid_size=GRID)
    assert model.text_conditional and model.prefix_len == SLOTS and model.config.caption_dim == CAPTION_DIM
    assert model.null_class is None and model.supports_cfg and model.num_classes is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_t2i_checkpoint_errors(tmp_path):
    state = upstream_t2i_state()
    del state["cls_embedding.uncond_embedding"]
    torch.save(state, str(tmp_path / "a.pt"))
    with pytest.raises(CheckpointMismatchError, match="cls_embedding.uncond_embedding"):
        load_llamagen(str(tmp_path / "a.pt"), TINY, grid_size=GRID)
    state = upstream_t2i_state()
    state["cls_embedding.cap_proj.fc1.bias"] = torch.zeros(32)
    torch.save(state, str(tmp_path / "b.pt"))
    with pytest.raises(CheckpointMismatchError, match="unexpected keys: cls_embedding.cap_proj.fc1.bias"):
        load_llamagen(str(tmp_path / "b.pt"), TINY, grid_size=GRID)


# ---- an independent transcription of LlamaGen's t2i sampling ----------------------------------
def upstream_t2i_logits(state, n_head, grid, caption_embs, emb_masks, idx, cfg, eps=1e-5):
    """Logits [rows, T + L, V] of LlamaGen's t2i pipeline from a raw state dict: sample_t2i.py's
    left padding of T5's right-padded features (flip the mask, rotate the features, zero the
    padding), generate()'s unconditional rows (uncond_embedding, masked with the conditional
    mask), its mask (causal * emb_masks, plus the diagonal) and the Transformer's equations."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    B, T, _ = caption_embs.shape
    new_masks = torch.flip(emb_masks, dims=[-1])
    new_embs = []
    for emb, mask in zip(caption_embs, emb_masks):
        n = int(mask.sum())
        new_embs.append(torch.cat([emb[n:], emb[:n]]))
    cond = torch.stack(new_embs) * new_masks[:, :, None]
    masks = new_masks
    if cfg:
        cond = torch.cat([cond, torch.zeros_like(cond) + state["cls_embedding.uncond_embedding"]])
        masks = torch.cat([new_masks, new_masks])
        idx = torch.cat([idx, idx])
    x = cond @ state["cls_embedding.cap_proj.fc1.weight"].T
    x = F.gelu(x, approximate="tanh") @ state["cls_embedding.cap_proj.fc2.weight"].T
    h = torch.cat([x, state["tok_embeddings.weight"][idx]], dim=1)
    R, L, D = h.shape
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool)).repeat(R, 1, 1).float()
    causal[:, :, :T] = causal[:, :, :T] * masks.unsqueeze(1)
    eye = torch.eye(L)
    attn_mask = (causal * (1 - eye) + eye).bool()[:, None]
    hd = D // n_head
    half = hd // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    t = torch.outer(torch.arange(grid).float(), freqs)
    ang = torch.cat([t[:, None].expand(-1, grid, -1), t[None].expand(grid, -1, -1)], -1).flatten(0, 1)
    cs = torch.stack([ang.cos(), ang.sin()], -1)
    cs = torch.cat([torch.zeros(T, hd // 2, 2), cs])[:L]               # the caption slots rotate by (0, 0)

    def rot(x):
        xc = torch.view_as_complex(x.reshape(R, L, n_head, hd // 2, 2).contiguous())
        return torch.view_as_real(xc * torch.complex(cs[..., 0], cs[..., 1])[None, :, None]).flatten(3)

    n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    for i in range(n_layer):
        p = f"layers.{i}."
        y = rms(h, state[p + "attention_norm.weight"])
        q, k, v = (y @ state[p + "attention.wqkv.weight"].T).split(D, -1)
        q, k, v = rot(q.view(R, L, n_head, hd)), rot(k.view(R, L, n_head, hd)), v.view(R, L, n_head, hd)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attn_mask)
        h = h + att.transpose(1, 2).reshape(R, L, D) @ state[p + "attention.wo.weight"].T
        y = rms(h, state[p + "ffn_norm.weight"])
        h = h + (F.silu(y @ state[p + "feed_forward.w1.weight"].T) * (y @ state[p + "feed_forward.w3.weight"].T)) \
            @ state[p + "feed_forward.w2.weight"].T
    return rms(h, state["norm.weight"]) @ state["output.weight"].T


def test_caption_prefix_matches_llamagen_t2i_pipeline(tmp_path):
    state = upstream_t2i_state(seed=3)
    torch.save({"model": state}, str(tmp_path / "t2i.pt"))
    model = load_llamagen(str(tmp_path / "t2i.pt"), TINY, grid_size=GRID)
    caps = captions([3, 8, 1])
    embs, masks = t5_style(caps)
    idx = torch.randint(0, VOCAB, (3, GRID * GRID - 1))
    ref = upstream_t2i_logits(state, 2, GRID, embs, masks, idx, cfg=True)      # [6, SLOTS + 15, V]
    cond_ref, uncond_ref = ref[:3, SLOTS - 1:], ref[3:, SLOTS - 1:]
    # the uncached SDPA path: the conditional rows, and the unconditional ones as LlamaGen forms them
    prompts = Prompts(caps)
    uncond = Prompts([state["cls_embedding.uncond_embedding"][SLOTS - c.shape[0]:] for c in caps])
    torch.testing.assert_close(model.teacher_forward(idx, prompts).logits[:, SLOTS - 1:], cond_ref, atol=3e-5, rtol=0)
    torch.testing.assert_close(model.teacher_forward(idx, uncond).logits[:, SLOTS - 1:], uncond_ref, atol=3e-5, rtol=0)
    # the cached protocol path with a CFG cache: prefill, then the tokens in two chunks
    cache = model.new_cache(3, cfg=True)
    first = model.prefill(cache, prompts)
    assert cache.valid[:, :SLOTS].sum(1).tolist() == [3, 3, 8, 8, 1, 1]     # padding slots stay invalid
    a = model.forward_tokens(cache, idx[:, :6], torch.arange(6))
    b = model.forward_tokens(cache, idx[:, 6:], torch.arange(6, 15))
    got = torch.cat([first.logits, a.logits, b.logits], 1)
    torch.testing.assert_close(got, join_cfg(cond_ref, uncond_ref), atol=3e-5, rtol=0)


def test_caption_errors_name_the_argument():
    model = tiny_t2i()
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match="Prompts"):
        model.prefill(cache, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"prompts\[0\] has 5 features per token"):
        model.prefill(cache, Prompts([torch.randn(3, 5)]))
    with pytest.raises(ValueError, match=r"prompts\[0\] has 9 tokens; the model takes 1 to 8"):
        model.prefill(cache, Prompts([torch.randn(9, CAPTION_DIM)]))
    with pytest.raises(ValueError, match=r"negative_prompts\[0\]"):
        model.prefill(model.new_cache(1, cfg=True), Prompts([torch.randn(2, CAPTION_DIM)], [torch.randn(2, 3)]))
    with pytest.raises(ValueError, match="negative captions"):
        model.prefill(cache, Prompts(captions([2])), uncond=torch.zeros(1, SLOTS, 32))
    with pytest.raises(ValueError, match="prompts has 2 entries"):
        model.prefill(cache, Prompts(captions([2, 3])))
    with pytest.raises(ValueError, match="text-to-image"):
        tiny_gpt(4).prefill(tiny_gpt(4).new_cache(1), Prompts(captions([2])))


# ---- ar against a full-sequence greedy loop ---------------------------------------------------
def greedy_reference(model, prompts: Prompts, negative, sampling: Sampling):
    """Greedy raster decoding by full recomputation: at step t the uncached SDPA forward over
    [caption ; tokens < t], guided by LlamaGen's rules written out here: mix only when guided
    (cfg_rule), and after the interval (t - 1 > cfg_interval > -1) the conditional logits."""
    B, HW = len(prompts), GRID * GRID
    x = torch.zeros(B, 0, dtype=torch.long)
    s = sampling.cfg_scale
    guided = s > 1.0 if sampling.cfg_rule == "llamagen" else s != 1.0
    for t in range(HW):
        with torch.no_grad():
            cond = model.teacher_forward(x, prompts).logits[:, SLOTS - 1 + t]
            logits = cond
            if guided:
                uncond = model.teacher_forward(x, negative).logits[:, SLOTS - 1 + t]
                interval_over = sampling.cfg_interval > -1 and t - 1 > sampling.cfg_interval
                logits = cond if interval_over else uncond + s * (cond - uncond)
        x = torch.cat([x, logits.argmax(-1, keepdim=True)], 1)
    return x.view(B, GRID, GRID)


@pytest.mark.parametrize("sampling", [
    Sampling(cfg_scale=3.0, top_k=1),
    Sampling(cfg_scale=3.0, top_k=1, cfg_interval=1, cfg_rule="llamagen"),
    Sampling(cfg_scale=3.0, top_k=1, cfg_interval=0.5),
    Sampling(cfg_scale=0.5, top_k=1),                       # today's rule: guided below 1 too
    Sampling(cfg_scale=0.5, top_k=1, cfg_rule="llamagen"),  # LlamaGen's: no guidance at all
    Sampling(cfg_scale=1.0, top_k=1),
], ids=["cfg3", "cfg3-interval1-llamagen", "cfg3-interval0.5", "cfg0.5-always", "cfg0.5-llamagen", "nocfg"])
@pytest.mark.parametrize("with_negative", [False, True])
def test_ar_top1_is_the_greedy_full_sequence_loop(sampling, with_negative):
    model = tiny_t2i(seed=1)
    caps = captions([3, 8, 1], seed=1)
    if with_negative:
        negative = captions([2, 5, 4], seed=2)
        prompts = Prompts(caps, negative)
        neg = Prompts(negative)
    else:
        prompts = Prompts(caps)
        neg = Prompts([model.cls_embedding.uncond_embedding[SLOTS - c.shape[0]:] for c in caps])
    ref = greedy_reference(model, Prompts(caps), neg, sampling)
    fam = {"target": model, "tokenizer": None}
    out = decoding.decode("ar", fam, prompts=prompts, sampling=sampling, batch_size=3)
    assert torch.equal(out.tokens, ref)
    # the guidance actually changes tokens here (else the comparison above proves little)
    if sampling.cfg_scale == 3.0 and not with_negative:
        plain = greedy_reference(model, Prompts(caps), neg, Sampling(top_k=1))
        assert not torch.equal(plain, ref)
    if sampling.cfg_interval == 1 and not with_negative:   # and so does moving the interval by one token
        for c in (0, 2):
            assert not torch.equal(greedy_reference(model, Prompts(caps), neg,
                                                    Sampling(cfg_scale=3.0, top_k=1, cfg_interval=c)), ref)


def test_ar_with_cfg_interval_reads_nothing_back_after_the_prefill():
    model = tiny_t2i()
    s = Sampling(cfg_scale=3.0, cfg_interval=5)
    runner = ModelRunner(model, s, batch=2, backend="cpu")
    prompts = Prompts(captions([2, 7]))
    first = runner.prefill(prompts)
    from specdec.decoding.streams import ImageStreams

    with count_host_syncs() as c:
        ar_grid(runner, prompts, ImageStreams(0, range(2)), start_out=first)
    assert c.round_trips == 0, c.by_op


# ---- cfg_interval and cfg_rule in the runner, against a hand computation ---------------------
def test_runner_probs_follow_cfg_interval_and_rule():
    model = tiny_gpt(4, seed=2)
    classes = torch.tensor([0, 2])
    tokens = torch.randint(0, 16, (2, 6))
    pos = torch.arange(6)
    raw = model.new_cache(2, cfg=True)
    first = model.prefill(raw, classes).logits
    out = model.forward_tokens(raw, tokens, pos).logits                  # [4, 6, V]: each image's cond row, then null
    cond, uncond = split_cfg(out)
    s, temp = 2.5, 1.3
    runner = ModelRunner(model, Sampling(cfg_scale=s, temperature=temp, cfg_interval=2), batch=2)
    p0 = runner.probs(runner.prefill(classes))
    torch.testing.assert_close(p0[:, 0], torch.softmax((first[1::2, 0] + s * (first[::2, 0] - first[1::2, 0])) / temp,
                                                       -1))
    p = runner.probs(runner.forward(tokens, pos))
    # the output fed at position n predicts token n + 1: guided while n + 1 - 1 <= 2
    for n in range(6):
        mixed = uncond[:, n] + s * (cond[:, n] - uncond[:, n]) if n <= 2 else cond[:, n]
        torch.testing.assert_close(p[:, n], torch.softmax(mixed / temp, -1), atol=1e-6, rtol=0)
    # cfg_rule: below 1 the default still mixes; LlamaGen's rule samples the conditional logits alone
    assert Sampling(cfg_scale=0.5).guided and not Sampling(cfg_scale=0.5, cfg_rule="llamagen").guided
    assert not Sampling(cfg_scale=1.0, cfg_rule="llamagen").guided and Sampling(cfg_scale=1.01,
                                                                                cfg_rule="llamagen").guided
    r = ModelRunner(model, Sampling(cfg_scale=0.5, temperature=temp, cfg_rule="llamagen"), batch=2)
    assert not r.cache.cfg
    r.prefill(classes)
    torch.testing.assert_close(r.probs(r.forward(tokens, pos)), torch.softmax(cond / temp, -1), atol=1e-6, rtol=0)
    r = ModelRunner(model, Sampling(cfg_scale=0.5, temperature=temp), batch=2)
    r.prefill(classes)
    torch.testing.assert_close(r.probs(r.forward(tokens, pos)),
                               torch.softmax((uncond + 0.5 * (cond - uncond)) / temp, -1), atol=1e-6, rtol=0)


def test_sampling_defaults_and_bad_values():
    assert Sampling().cfg_interval == -1 and Sampling().cfg_rule == "always"
    assert not Sampling(cfg_scale=2.0).has_cfg_interval and Sampling(cfg_scale=2.0, cfg_interval=0).has_cfg_interval
    with pytest.raises(ValueError, match="cfg_rule"):
        Sampling(cfg_rule="sometimes")
    with pytest.raises(ValueError, match="cfg_interval"):
        Sampling(cfg_interval=float("nan"))


# ---- every method, batched -------------------------------------------------------------------
class T2IFamily(TinyFamily):
    """TinyFamily's pieces around text-to-image models: a 4x4 t2i target, a 2x2 t2i drafter, a
    smaller same-grid t2i drafter, SSD heads, the stand-in tokenizer and codebook."""

    def __init__(self):
        super().__init__(vocab=VOCAB)
        self.target = tiny_t2i(4, seed=0)
        self.drafter = tiny_t2i(2, seed=1)
        self.sd_drafter = tiny_t2i(4, seed=3, dim=16, layers=1)
        self.ssd_heads = tiny_heads(32, width=4, seed=2, vertical=2)


@pytest.fixture(scope="module")
def t2i_family():
    return T2IFamily()


@pytest.mark.parametrize("method", decoding.METHODS)
def test_every_method_decodes_batched_prompts_of_different_lengths(t2i_family, method):
    """Each image's tokens are those it gets alone (batch-invariant numerics, reference backend):
    the padding of one image's caption never reaches another's rows."""
    prompts = Prompts(captions([3, 8, 1, 5]), [None, captions([4])[0], None, None])
    sampling = Sampling(cfg_scale=2.0, cfg_interval=6)
    with batch_invariant():
        alone = torch.cat([decoding.decode(method, t2i_family, prompts=prompts[i:i + 1], seed=4, first_index=i,
                                           sampling=sampling, backend="reference").tokens for i in range(4)])
        out = decoding.decode(method, t2i_family, prompts=prompts, seed=4, sampling=sampling, backend="reference",
                              batch_size=3)
        concurrent = decoding.decode(method, t2i_family, prompts=prompts, seed=4, sampling=sampling,
                                     backend="reference", concurrency=3)
        # a stream: captions arriving while others decode (the caption's slots are the model's
        # fixed prefix, masked past each caption's length)
        engine = decoding.stream(method, t2i_family, concurrency=2, seed=4, sampling=sampling, backend="reference")
        streamed = {}
        for i in range(4):
            engine.submit(prompt=prompts.cond[i], negative_prompt=prompts.negative[i])
            streamed.update((image.index, image.tokens) for image in engine.step())
        streamed.update((image.index, image.tokens) for image in engine.results())
    assert out.tokens.shape == (4, 4, 4) and out.images.shape[0] == 4
    assert torch.equal(out.tokens, alone)
    assert torch.equal(concurrent.tokens, alone)
    assert torch.equal(torch.stack([streamed[i] for i in range(4)]), alone)


@pytest.mark.slow
def test_compiled_ar_keeps_cfg_interval_in_one_graph():
    """The interval is a tensor comparison inside the compiled step (fullgraph=True: no break)."""
    fam = {"target": tiny_t2i(), "tokenizer": None}
    s = Sampling(cfg_scale=3.0, cfg_interval=2)
    prompts = Prompts(captions([3, 8, 2]))
    eager = decoding.decode("ar", fam, prompts=prompts, sampling=s, batch_size=3, seed=1)
    compiled = decoding.decode("ar", fam, prompts=prompts, sampling=s, batch_size=3, seed=1, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)


def test_caption_files_read_as_llamagen_reads_t5_output(tmp_path):
    from specdec.models import read_caption_embeddings

    caps, neg = captions([3, 8]), captions([2, 1], seed=9)
    embs, masks = t5_style(caps)
    nembs, nmasks = t5_style(neg)
    torch.save({"caption_embs": embs, "emb_masks": masks, "negative_embs": nembs, "negative_masks": nmasks},
               str(tmp_path / "c.pt"))
    p = read_caption_embeddings(str(tmp_path / "c.pt"))
    assert [c.shape[0] for c in p.cond] == [3, 8] and all(torch.equal(a, b) for a, b in zip(p.cond, caps))
    assert all(torch.equal(a, b) for a, b in zip(p.negative, neg))
    torch.save(embs[0], str(tmp_path / "bare.pt"))                        # one caption, every token valid
    assert read_caption_embeddings(str(tmp_path / "bare.pt")).cond[0].shape == (SLOTS, CAPTION_DIM)
    holes = masks.clone()
    holes[0, 1] = 0
    torch.save({"caption_embs": embs, "emb_masks": holes}, str(tmp_path / "holes.pt"))
    with pytest.raises(ValueError, match="right-padded"):
        read_caption_embeddings(str(tmp_path / "holes.pt"))
    torch.save({"embs": embs}, str(tmp_path / "keys.pt"))
    with pytest.raises(ValueError, match="caption_embs"):
        read_caption_embeddings(str(tmp_path / "keys.pt"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_caption_embeddings(str(tmp_path / "none.pt"))
