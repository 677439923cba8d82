"""HFImageModel, the base of the transformers adapters, on a tiny random Llama whose image
tokens are a contiguous range of its text vocabulary (the Emu3 / Chameleon layout), with and
without a row-end token: prompts of different lengths, one-token decoding against transformers'
own full forward (sdpa), multi-token forwards with holes and tree masks against one-token feeding,
write=False, the unchecked path and invalidation (row ends included)."""
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from specdec import masks  # noqa: E402
from specdec.models import ARImageModel  # noqa: E402
from specdec.models.conditions import Prompts  # noqa: E402
from specdec.models.hf.base import HFImageModel  # noqa: E402

ATOL = 5e-5
IMAGE0, V, GRID = 20, 24, (3, 4)   # image token v is text id IMAGE0 + v
EOL = 5                              # the fake row-end id


class RangeImageModel(HFImageModel):
    """Image tokens = text ids [IMAGE0, IMAGE0 + V); logits = lm_head over that range."""

    @property
    def language_model(self):
        return self.hf_model.model

    def embed_image(self, tokens):
        return self.embed_text(tokens + IMAGE0)

    def image_logits(self, normed):
        return self.hf_model.lm_head(normed)[..., IMAGE0:IMAGE0 + V].float()

    def unconditional_prompt(self, ids):
        return torch.cat([ids[:1], torch.full_like(ids[1:], 1)])


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def model(row_end=None, seed=0):
    return RangeImageModel(tiny_llama(seed), grid=GRID, vocab_size=V, max_prompt_len=8, row_end_token=row_end)


def sequence(prompt, tokens, row_end):
    """The model's own text sequence: prompt, image ids, a row end after every row."""
    W = GRID[1]
    seq = list(prompt.tolist())
    for u, t in enumerate(tokens):
        seq.append(IMAGE0 + int(t))
        if row_end is not None and u % W == W - 1:
            seq.append(row_end)
    return torch.tensor(seq)


def hf_image_logits(hf, seq):
    """transformers' own forward (sdpa, no cache) -> image logits at every sequence position."""
    hf.model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            return hf(seq[None]).logits[0, :, IMAGE0:IMAGE0 + V].float()
    finally:
        hf.model.config._attn_implementation = "specdec"


def test_satisfies_protocol():
    assert isinstance(model(), ARImageModel)


@pytest.mark.parametrize("row_end", [None, EOL])
def test_one_token_decoding_equals_transformers_forward(row_end):
    m = model(row_end)
    H, W = GRID
    prompts = [torch.tensor([1, 7, 9, 11, 3]), torch.tensor([1, 8, 3])]   # different lengths
    tokens = torch.randint(0, V, (2, H * W))
    cache = m.new_cache(2)
    with torch.no_grad():
        outs = [m.prefill(cache, Prompts(prompts)).logits]
        for u in range(H * W - 1):
            outs.append(m.forward_tokens(cache, tokens[:, u:u + 1], torch.tensor([u])).logits)
    got = torch.cat(outs, 1)                                             # [2, HW, V]
    assert cache.prefix_len == m.max_prompt_len == 8
    for b in range(2):
        seq = sequence(prompts[b], tokens[b], row_end)
        ref = hf_image_logits(m.hf_model, seq)
        # the position predicting raster token u: the prompt's last, then each token's (its row end's)
        idx = [len(prompts[b]) - 1]
        for u in range(H * W - 1):
            idx.append(len(prompts[b]) + u + (0 if row_end is None else u // W + int(u % W == W - 1)))
        torch.testing.assert_close(got[b], ref[idx], atol=ATOL, rtol=0)


def test_layers_take_the_cache_by_the_keyword_of_the_installed_transformers():
    """transformers 5.25 renamed the layers' `past_key_values` to `cache` (the old name warns on
    every call, and goes in 5.40): the adapters pass whichever the installed release's layers
    take, so a decode warns nothing (CI runs this on the pinned and on the newest transformers)."""
    from specdec.models.hf.cache import cache_keyword

    def new(h, cache=None):
        return h

    def old(h, past_key_values=None):
        return h
    assert cache_keyword(new) == "cache" and cache_keyword(old) == "past_key_values"
    m = model()
    cache = m.new_cache(1)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        m.prefill(cache, Prompts([torch.tensor([1, 7, 3])]))
        m.forward_tokens(cache, torch.tensor([[2, 5]]), torch.tensor([0, 1]))
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def _one_by_one(m, cache, tokens, positions):
    """Feed tokens [rows, N] at positions [rows, N] one token at a time, in order."""
    outs = [m.forward_tokens(cache, tokens[:, i:i + 1], positions[:, i:i + 1]).logits for i in range(tokens.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("row_end", [None, EOL])
def test_holes_equal_one_by_one(row_end, checked):
    """Positions with holes, different per row (islands / ZipAR rows): one forward equals feeding
    the tokens in turn, and leaves the same cache behind."""
    m = model(row_end)
    prompts = Prompts([torch.tensor([1, 7, 9, 3]), torch.tensor([1, 3])])
    a, b = m.new_cache(2, cfg=True), m.new_cache(2, cfg=True)
    tokens = torch.randint(0, V, (2, 5))
    positions = torch.tensor([[0, 1, 3, 4, 7], [2, 3, 5, 8, 11]])       # row ends at 3, 7, 11
    with torch.no_grad():
        m.prefill(a, prompts), m.prefill(b, prompts)
        got = m.forward_tokens(a, tokens, positions, checked=checked).logits
        ref = _one_by_one(m, b, tokens.repeat_interleave(2, 0), positions.repeat_interleave(2, 0))   # (CFG rows)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        # the caches agree: the same next step
        nxt = torch.tensor([[8], [9]]), torch.randint(0, V, (2, 1))
        torch.testing.assert_close(m.forward_tokens(a, nxt[1], nxt[0]).logits,
                                   m.forward_tokens(b, nxt[1], nxt[0]).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("row_end", [None, EOL])
def test_tree_equals_feeding_each_branch(row_end, checked):
    """A draft tree (write=False) whose branches cross a row end: node i's output equals feeding
    its root-to-node path one token at a time on a copy of the cache; the cache is untouched."""
    m = model(row_end)
    prompts = Prompts([torch.tensor([1, 7, 9, 3])])
    cache = m.new_cache(1)
    with torch.no_grad():
        m.prefill(cache, prompts)
        m.forward_tokens(cache, torch.randint(0, V, (1, 2)), torch.tensor([0, 1]))
        parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])                      # positions 2, 3, 3, 4, 4, 5
        tree = masks.tree_from_parents(parents)
        positions = 2 + tree.depth
        tokens = torch.randint(0, V, (1, 6))
        before = cache.valid.clone()
        got = m.forward_tokens(cache, tokens, positions, tree_mask=tree.tree_mask, write=False, checked=checked).logits
        assert torch.equal(cache.valid, before)
        for i in range(6):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(parents[0, j])
            path = path[::-1]
            ref = _one_by_one(m, cache.clone(), tokens[:, path], positions[:, path])[:, -1]
            torch.testing.assert_close(got[:, i], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("row_end", [None, EOL])
def test_invalidate_where(row_end):
    """Forget positions with `where` (a different count per image): a later query sees what it
    would in a cache that only ever held the kept tokens. Position 3 ends row 0: its row end is
    forgotten with it (else image 0's query would still see it)."""
    m = model(row_end)
    prompts = [torch.tensor([1, 7, 3]), torch.tensor([1, 9, 9, 3])]
    cache = m.new_cache(2)
    old, probe = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 1))
    forget = torch.tensor([[False] * 3 + [True] * 4, [False] * 5 + [True] * 2])
    with torch.no_grad():
        m.prefill(cache, Prompts(prompts))
        m.forward_tokens(cache, old, torch.arange(7))
        cache.invalidate_positions(torch.arange(7).expand(2, 7), where=forget)
        got = m.forward_tokens(cache, probe, torch.tensor([7]), write=False).logits
        for i, kept in enumerate((3, 5)):
            ref_cache = m.new_cache(1)
            m.prefill(ref_cache, Prompts([prompts[i]]))
            m.forward_tokens(ref_cache, old[i:i + 1, :kept], torch.arange(kept))
            ref = m.forward_tokens(ref_cache, probe[i:i + 1], torch.tensor([7]), write=False).logits
            torch.testing.assert_close(got[i:i + 1], ref, atol=ATOL, rtol=0)


def test_write_false_and_reach():
    m = model(EOL)
    cache = m.new_cache(1)
    with torch.no_grad():
        m.prefill(cache, Prompts([torch.tensor([1, 3])]))
        tokens = torch.randint(0, V, (1, 6))
        k0 = [t.clone() for t in cache.k]
        scored = m.forward_tokens(cache, tokens, torch.arange(6), write=False).logits
        assert all(torch.equal(x, y) for x, y in zip(k0, cache.k))
        fast = m.forward_tokens(cache, tokens, torch.arange(6), checked=False, reach=5).logits
        torch.testing.assert_close(scored, fast, atol=ATOL, rtol=0)


def test_bad_input():
    m = model()
    cache = m.new_cache(1)
    with pytest.raises(ValueError, match="max_prompt_len"):
        m.prefill(cache, Prompts([torch.arange(1, 12)]))
    with pytest.raises(ValueError, match="Prompts batch"):
        m.prefill(cache, torch.tensor([1, 2]))
    m.prefill(cache, Prompts([torch.tensor([1, 3])]))
    with pytest.raises(ValueError, match="tokens must lie"):
        m.forward_tokens(cache, torch.tensor([[V]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="positions must lie"):
        m.forward_tokens(cache, torch.tensor([[0]]), torch.tensor([12]))
    with pytest.raises(ValueError, match="repeat"):
        m.forward_tokens(cache, torch.tensor([[0, 1]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="string prompts need a processor"):
        m.encode_prompts(["a cat"])


@pytest.mark.parametrize("bad", [None, 5, b"ab", ["ab", "cd"], [1.5, 2.5], torch.zeros(0, dtype=torch.long)])
def test_a_prompt_that_is_not_token_ids_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"^prompts\[1\] must be a string or non-empty 1-D int token ids"):
        model().encode_prompts([torch.tensor([1, 2]), bad])
    if bad is not None:     # (a None negative prompt is the model's own)
        with pytest.raises(ValueError, match=r"^negative_prompts\[0\] must be"):
            model().encode_prompts([torch.tensor([1, 2])], [bad])


def test_prompt_rows_are_named_by_their_argument_in_errors():
    """CFG interleaves each image's conditional and unconditional rows in the cache: an error names
    the argument the row came from, not the row."""
    m = model()
    cache = m.new_cache(2, cfg=True)
    ok, oov, long = torch.tensor([1, 2]), torch.tensor([1, 64]), torch.arange(1, 12)
    with pytest.raises(ValueError, match=r"^negative_prompts\[1\] has token ids outside \[0, 64\)"):
        m.prefill(cache, Prompts([ok, ok], [None, oov]))
    with pytest.raises(ValueError, match=r"^prompts\[1\] has token ids outside"):
        m.prefill(cache, Prompts([ok, oov]))
    with pytest.raises(ValueError, match=r"^negative_prompts\[0\] has 11 tokens; .*max_prompt_len=8"):
        m.prefill(cache, Prompts([ok, ok], [long, None]))
    with pytest.raises(ValueError, match=r"^the model's unconditional prompt \(for prompts\[1\]\) has token ids"):
        m.unconditional_prompt = lambda ids: torch.full_like(ids, 99)
        m.prefill(cache, Prompts([ok, ok], [ok, None]))


def test_an_adapter_must_define_the_hooks():
    """The base is abstract: a subclass without the model-specific hooks cannot be built, and one
    without a default unconditional prompt asks for negative prompts by name."""
    from specdec.models.hf.base import HFImageModel

    class Incomplete(HFImageModel):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(None, grid=(2, 2), vocab_size=4)

    class NoDefault(HFImageModel):
        language_model = None

        def embed_image(self, tokens):
            return tokens

        def image_logits(self, normed):
            return normed

    model = object.__new__(NoDefault)
    with pytest.raises(ValueError, match="pass negative_prompts"):
        model.unconditional_prompt(torch.tensor([1, 2]))
