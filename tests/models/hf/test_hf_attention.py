"""attn_implementation="specdec" (specdec.integrations.transformers) equals transformers' "sdpa"
(float32 tolerance) on the language models of Janus (Llama), Emu3 and Chameleon, tiny and random:
causal prefill (also left-padded), chunked verification on a cache, and a draft tree passed as the
visibility keyword arguments (against sdpa with the same rule as a dense mask)."""
import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import specdec  # noqa: E402
from specdec import masks  # noqa: E402
from specdec.integrations.transformers import register  # noqa: E402
from specdec.models.hf.cache import HFSlotCache, cache_keyword  # noqa: E402

ATOL = 2e-5
VOCAB = 64
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))


def emu3():
    return transformers.Emu3ForCausalLM(transformers.Emu3TextConfig(**TEXT, pad_token_id=0, bos_token_id=1,
                                                                    eos_token_id=2))


def chameleon():
    vq = dict(embed_dim=8, num_embeddings=16, latent_channels=8, resolution=32, base_channels=32,
              channel_multiplier=[1, 2], num_res_blocks=1)
    return transformers.ChameleonForConditionalGeneration(transformers.ChameleonConfig(**TEXT, vq_config=vq,
                                                                                       vocabulary_map={}))


ARCHS = {"llama": llama, "emu3": emu3, "chameleon": chameleon}


def build(name):
    register()
    torch.manual_seed(0)
    m = ARCHS[name]().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def text_config(m):
    return m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config


def logits(m, impl, **kw):
    text_config(m)._attn_implementation = impl
    with torch.no_grad():
        return m(**kw).logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_causal_prefill(arch):
    m = build(arch)
    ids = torch.randint(3, VOCAB, (2, 9))
    torch.testing.assert_close(logits(m, "specdec", input_ids=ids), logits(m, "sdpa", input_ids=ids), atol=ATOL, rtol=0)
    # left padding: the mask transformers builds (compared where the tokens are real)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    got = logits(m, "specdec", input_ids=ids, attention_mask=mask)
    ref = logits(m, "sdpa", input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_verification(arch):
    """A prompt, then a chunk of 5 drafted tokens scored at once on the cache."""
    m = build(arch)
    ids = torch.randint(3, VOCAB, (2, 12))
    out = {}
    for impl in ("specdec", "sdpa"):
        cache = DynamicCache(config=text_config(m))
        logits(m, impl, input_ids=ids[:, :7], **{cache_keyword(m.forward): cache}, use_cache=True)
        out[impl] = logits(m, impl, input_ids=ids[:, 7:], **{cache_keyword(m.forward): cache}, use_cache=True)
    torch.testing.assert_close(out["specdec"], out["sdpa"], atol=ATOL, rtol=0)
    # specdec's slot cache as past_key_values of a plain call (append mode): the same
    c = text_config(m)
    cache = HFSlotCache(c.num_hidden_layers, 2, c.num_key_value_heads, 16, c.hidden_size // c.num_attention_heads)
    logits(m, "specdec", input_ids=ids[:, :7], **{cache_keyword(m.forward): cache}, use_cache=True)
    chunk = logits(m, "specdec", input_ids=ids[:, 7:], **{cache_keyword(m.forward): cache}, use_cache=True)
    torch.testing.assert_close(chunk, out["sdpa"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tree_through_kwargs(arch):
    """A 5-token prefix and a 6-node draft tree in one forward: the visibility rule as keyword
    arguments (positions, validity with a hole, packed tree mask) equals sdpa with that rule as a
    dense 4-D mask. RoPE positions are the prefix index, then 5 + depth."""
    m = build(arch)
    P = 5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    tree = masks.tree_from_parents(parents)
    N = P + 6
    # one tree mask over the whole block: the prefix causal, the nodes see the prefix and their ancestors
    dense = torch.zeros(1, N, N, dtype=torch.bool)
    dense[0, :P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
    dense[0, P:, :P] = True
    dense[0, P:, P:] = masks.unpack(tree.tree_mask, 6)[0]
    pos = torch.cat([torch.arange(P), P + tree.depth[0]])[None]
    valid = torch.ones(1, N, dtype=torch.bool)
    valid[0, 2] = False                                    # a hole in the prefix
    q_pos = torch.full((1, N), N, dtype=torch.int32)       # the tree mask alone orders the block
    kv_pos = torch.zeros(1, N, dtype=torch.int32)
    ids = torch.randint(3, VOCAB, (1, N))
    got = logits(m, "specdec", input_ids=ids, position_ids=pos, q_pos=q_pos, kv_pos=kv_pos, kv_valid=valid,
                 tree_mask=masks.pack(dense))
    rule = masks.visibility(q_pos, kv_pos, valid, masks.pack(dense))
    ref = logits(m, "sdpa", input_ids=ids, position_ids=pos, attention_mask=rule[:, None])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_refuses_what_it_cannot_express():
    m = build("llama")
    text_config(m)._attn_implementation = "specdec"
    ids = torch.randint(3, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="need q_pos"):
        m(input_ids=ids, kv_valid=torch.ones(1, 4, dtype=torch.bool))


def test_a_mask_the_rule_cannot_express_is_refused_not_mistranslated():
    # Two packed sequences (block-diagonal causal): the second one's queries must not see the first's
    # keys, which the rule (a last visible key per query) would show them. A left-padded mask,
    # which it can express, passes the same check (test_causal_prefill).
    m = build("llama")
    ids = torch.randint(3, VOCAB, (1, 9))
    packed = torch.zeros(1, 1, 9, 9, dtype=torch.bool)
    packed[0, 0, :4, :4] = torch.ones(4, 4).tril().bool()
    packed[0, 0, 4:, 4:] = torch.ones(5, 5).tril().bool()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="not a causal mask with key padding"):
        logits(m, "specdec", input_ids=ids, attention_mask=packed, position_ids=positions)
    causal = torch.ones(1, 1, 9, 9).tril().bool()
    torch.testing.assert_close(logits(m, "specdec", input_ids=ids, attention_mask=causal),
                               logits(m, "sdpa", input_ids=ids, attention_mask=causal), atol=ATOL, rtol=0)


def test_attention_sinks_are_refused():
    from specdec.integrations.transformers import specdec_attention_forward

    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="attention sinks"):
        specdec_attention_forward(torch.nn.Module(), q, k, k, None, s_aux=torch.zeros(2))


@pytest.mark.skipif(not specdec.build_info()["cpu_kernels"], reason="C++ extension not built")
def test_a_loss_through_the_kernels_raises_on_backward_instead_of_dropping_gradients():
    m = build("llama").train()
    text_config(m)._attn_implementation = "specdec"
    ids = torch.randint(3, VOCAB, (2, 6))
    loss = m(input_ids=ids, labels=ids).loss       # (the forward is allowed: inference without no_grad)
    with pytest.raises(RuntimeError, match="tree_attention has no backward on the"):
        loss.backward()


def test_a_padded_batch_under_inference_mode_is_checked_and_equals_sdpa():
    # (a mask made under inference_mode has no version counter: the check must not ask for one)
    m = build("llama")
    ids = torch.randint(3, VOCAB, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, :3] = 0
    with torch.inference_mode():
        got = logits(m, "specdec", input_ids=ids, attention_mask=padding)
        want = logits(m, "sdpa", input_ids=ids, attention_mask=padding)
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=ATOL, rtol=0)
