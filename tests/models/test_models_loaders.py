"""LlamaGen-compatible loading, proven without downloads: key/shape manifests of the released
sizes built on the meta device, round trips of tiny random checkpoints written in LlamaGen's
layout (every wrapper format), clear errors, and a forward pass checked against an independent
transcription of LlamaGen's GPT equations."""
import math

import pytest
import torch
import torch.nn.functional as F

from specdec.models import (CheckpointMismatchError, LlamaGenGPT, LlamaGenVQ, LlamaGenVQConfig,
                            llamagen_manifest, load_llamagen, load_llamagen_vq)
from specdec.models.loaders import llamagen_gpt_config

from llamagen_models import TINY, random_llamagen_state
TINY_VQ = {"ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1, "z_channels": 32}


# ---- manifests of the real checkpoints --------------------------------------------------------
@pytest.mark.parametrize("name, millions", [("GPT-B", 111), ("GPT-L", 343), ("GPT-XL", 775)])
def test_gpt_manifest_matches_published_sizes(name, millions):
    m = llamagen_manifest(name)
    total = sum(math.prod(s) for s in m.values())
    assert round(total / 1e6) == millions  # the parameter counts LlamaGen's gpt.py states
    dim = {"GPT-B": 768, "GPT-L": 1024, "GPT-XL": 1280}[name]
    assert m["tok_embeddings.weight"] == (16384, dim)
    assert m["cls_embedding.embedding_table.weight"] == (1001, dim)  # 1000 classes + null class
    assert m["layers.0.attention.wqkv.weight"] == (3 * dim, dim)
    assert m["layers.0.attention.wo.weight"] == (dim, dim)
    hidden = m["layers.0.feed_forward.w1.weight"][0]
    assert hidden % 256 == 0 and m["layers.0.feed_forward.w2.weight"] == (dim, hidden)
    assert m["output.weight"] == (16384, dim) and m["norm.weight"] == (dim,)
    assert not any(k.endswith(".bias") for k in m)
    assert "freqs_cis" not in m and "rope" not in m


def test_vq16_manifest():
    m = llamagen_manifest("VQ-16")
    assert m["quantize.embedding.weight"] == (16384, 8)
    assert m["quant_conv.weight"] == (8, 256, 1, 1) and m["post_quant_conv.weight"] == (256, 8, 1, 1)
    assert m["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert m["encoder.conv_blocks.4.attn.1.q.weight"] == (512, 512, 1, 1)
    assert m["encoder.conv_blocks.1.res.0.conv1.weight"] == (128, 128, 3, 3)
    assert m["encoder.conv_blocks.2.res.0.nin_shortcut.weight"] == (256, 128, 1, 1)
    assert m["decoder.conv_blocks.0.res.2.conv2.weight"] == (512, 512, 3, 3)  # num_res_blocks + 1 per level
    assert m["decoder.conv_blocks.3.upsample.conv.weight"] == (128, 128, 3, 3)
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in m
    assert round(sum(math.prod(s) for s in m.values()) / 1e6) == 72  # LlamaGen's 72M tokenizer


# ---- an independent transcription of LlamaGen's forward --------------------------------------
def llamagen_equations(state, n_head, grid, cond, idx, eps=1e-5):
    """Logits of LlamaGen's c2i Transformer (training-mode layout: [cls ; idx]) from a raw state dict."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    h = torch.cat([state["cls_embedding.embedding_table.weight"][cond][:, None],
                   state["tok_embeddings.weight"][idx]], dim=1)
    B, L, D = h.shape
    hd = D // n_head
    half = hd // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    t = torch.outer(torch.arange(grid).float(), freqs)
    ang = torch.cat([t[:, None].expand(-1, grid, -1), t[None].expand(grid, -1, -1)], -1).flatten(0, 1)
    ang = torch.cat([torch.zeros(1, hd // 2), ang])[:L]
    cos, sin = ang.cos(), ang.sin()
    cos[0] = 0.0  # the prefix row of LlamaGen's table is (0, 0), not (cos 0, sin 0)
    sin[0] = 0.0

    def rot(x):  # x [B, L, H, hd]: complex multiplication of consecutive pairs
        xc = torch.view_as_complex(x.reshape(B, L, n_head, hd // 2, 2).contiguous())
        return torch.view_as_real(xc * torch.complex(cos, sin)[None, :, None]).flatten(3)

    n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    for i in range(n_layer):
        p = f"layers.{i}."
        x = rms(h, state[p + "attention_norm.weight"])
        q, k, v = (x @ state[p + "attention.wqkv.weight"].T).split(D, -1)
        q, k, v = rot(q.view(B, L, n_head, hd)), rot(k.view(B, L, n_head, hd)), v.view(B, L, n_head, hd)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + att.transpose(1, 2).reshape(B, L, D) @ state[p + "attention.wo.weight"].T
        x = rms(h, state[p + "ffn_norm.weight"])
        ff = F.silu(x @ state[p + "feed_forward.w1.weight"].T) * (x @ state[p + "feed_forward.w3.weight"].T)
        h = h + ff @ state[p + "feed_forward.w2.weight"].T
    return rms(h, state["norm.weight"]) @ state["output.weight"].T


def test_forward_matches_llamagen_equations():
    state = random_llamagen_state()
    model = LlamaGenGPT(llamagen_gpt_config(TINY, vocab_size=40, num_classes=5, grid_size=4))
    model.load_state_dict(state)
    idx = torch.randint(0, 40, (3, 15))
    cond = torch.tensor([0, 4, 5])
    ref = llamagen_equations(state, 2, 4, cond, idx)
    torch.testing.assert_close(model.teacher_forward(idx, cond).logits, ref, atol=2e-5, rtol=0)


# ---- round trips in every wrapper format ------------------------------------------------------
def _write(tmp_path, state, fmt):
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "ckpt.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        return str(path)
    payload = {"raw": state, "model": {"model": state, "steps": 100},
               "module": {"module": state}, "ddp": {"model": {"module." + k: v for k, v in state.items()}}}[fmt]
    path = tmp_path / "ckpt.pt"
    torch.save(payload, str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["raw", "model", "module", "ddp", "safetensors"])
def test_gpt_round_trip(tmp_path, fmt):
    state = random_llamagen_state(seed=1)
    # LlamaGen checkpoints may carry the rotary table; it must be ignored.
    with_extras = dict(state, freqs_cis=torch.zeros(17, 8, 2))
    model = load_llamagen(_write(tmp_path, with_extras, fmt), TINY, grid_size=4)
    assert model.config.vocab_size == 40 and model.num_classes == 5 and model.null_class == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    idx = torch.randint(0, 40, (2, 15))
    ref = llamagen_equations(state, 2, 4, torch.tensor([1, 5]), idx)
    torch.testing.assert_close(model.teacher_forward(idx, torch.tensor([1, 5])).logits, ref, atol=2e-5, rtol=0)


def test_gpt_missing_and_unexpected_keys_are_listed(tmp_path):
    state = random_llamagen_state()
    del state["layers.1.feed_forward.w2.weight"]
    state["layers.1.attention.wqkv.bias"] = torch.zeros(96)
    with pytest.raises(CheckpointMismatchError, match=r"missing keys: layers\.1\.feed_forward\.w2\.weight.*"
                                                      r"unexpected keys: layers\.1\.attention\.wqkv\.bias"):
        load_llamagen(_write(tmp_path, state, "raw"), TINY, grid_size=4)


def test_gpt_wrong_size_is_a_shape_error(tmp_path):
    state = random_llamagen_state()
    with pytest.raises(CheckpointMismatchError, match="shape mismatches"):
        load_llamagen(_write(tmp_path, state, "raw"), dict(TINY, n_head=4, dim=64), grid_size=4)
    with pytest.raises(CheckpointMismatchError, match="unexpected keys: layers.1"):
        load_llamagen(_write(tmp_path, state, "raw"), dict(TINY, n_layer=1), grid_size=4)


def test_unknown_config_name():
    with pytest.raises(ValueError, match="config_name"):
        load_llamagen(__file__, "GPT-Q")


def test_not_a_gpt_checkpoint(tmp_path):
    with pytest.raises(CheckpointMismatchError, match="tok_embeddings"):
        load_llamagen(_write(tmp_path, {"foo": torch.zeros(2)}, "raw"), "GPT-B")


@pytest.mark.parametrize("fmt", ["model", "safetensors"])
def test_vq_round_trip(tmp_path, fmt):
    torch.manual_seed(0)
    cfg = LlamaGenVQConfig(codebook_size=64, codebook_embed_dim=4, **TINY_VQ)
    original = LlamaGenVQ(cfg).eval()
    state = dict(original.state_dict())
    state["quantize.codebook_used"] = torch.zeros(65536)  # LlamaGen's usage counter buffer
    loaded = load_llamagen_vq(_write(tmp_path, state, fmt), TINY_VQ)
    assert loaded.codebook_size == 64 and loaded.codebook.shape == (64, 4)
    torch.testing.assert_close(loaded.codebook.norm(dim=-1), torch.ones(64))
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    codes = loaded.encode(images)
    assert codes.shape == (2, 8, 8) and torch.equal(codes, original.encode(images))
    # Quantisation picks the nearest l2-normalised code (LlamaGen's rule), checked directly.
    z = F.normalize(original.quant_conv(original.encoder(images)), dim=1).permute(0, 2, 3, 1)
    dist = torch.cdist(z.reshape(-1, 4), loaded.codebook)
    assert torch.equal(codes.flatten(), dist.argmin(-1))
    assert loaded.decode(codes).shape == (2, 3, 16, 16)


def test_vq_missing_keys(tmp_path):
    cfg = LlamaGenVQConfig(codebook_size=64, codebook_embed_dim=4, **TINY_VQ)
    state = dict(LlamaGenVQ(cfg).state_dict())
    del state["decoder.conv_out.weight"]
    with pytest.raises(CheckpointMismatchError, match="decoder.conv_out.weight"):
        load_llamagen_vq(_write(tmp_path, state, "raw"), TINY_VQ)
