"""Prompts on the scheduler: text-conditioned families (a tiny random transformers Janus, and
GLM-Image's two stages) with prompts of different lengths arriving while other images decode.
Every row's prompt ends at the model's `max_prompt_len` slot (one prefix length for the whole
cache), so each image is bit for bit its decode alone under `batch_invariant()` on the reference
backend, whatever prompts run beside it and whenever it arrives."""
import functools

import pytest
import torch

pytest.importorskip("transformers")

from decoding_models import single_thread  # noqa: E402, F401  (autouse fixture)
from glm_image_models import prompt_ids, tiny_glm_image  # noqa: E402
from janus_models import BOI, BOS, tiny_janus  # noqa: E402

from specdec import decoding  # noqa: E402
from specdec.models import hf  # noqa: E402
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig  # noqa: E402
from specdec.numerics import batch_invariant  # noqa: E402
from specdec.settings import Sampling  # noqa: E402

#: prompts of four lengths
PROMPTS = [torch.tensor([BOS, 9, 12, 7, 20, BOI]), torch.tensor([BOS, 30, 5, BOI]),
           torch.tensor([BOS, 4, 4, 8, 9, 10, 11, BOI]), torch.tensor([BOS, 6, BOI])]
OPTIONS = {"ar": {}, "sd": dict(chunk=3), "lantern": dict(chunk=3, k=4), "sjd": dict(window=4),
           "zipar": dict(window=2), "mulo": dict(upsample="nearest", k=4),
           "ssd": dict(rounds=1, chunk=3, commit="write")}


@pytest.fixture(scope="module")
def janus():
    target = tiny_janus(patches=4, seed=0, layers=1)
    low = tiny_janus(patches=2, seed=1, layers=1)
    low.model.vqmodel.load_state_dict(target.model.vqmodel.state_dict())   # MuLo-SD: one codebook
    fam = hf.wrap(target, max_prompt_len=12)
    fam.drafter = hf.wrap(low, max_prompt_len=12).target
    fam.sd_drafter = hf.wrap(tiny_janus(patches=4, seed=2, layers=1), max_prompt_len=12).target
    torch.manual_seed(3)
    fam.ssd_heads = SSDHeads(SSDHeadsConfig(dim=fam.target.hidden_dim, grid_width=4, ffn_hidden=16)).eval()
    return fam


def _alone(fam, method, prompts, **kw):
    return [decoding.decode(method, fam, prompts=prompts[i:i + 1], first_index=i, **kw).tokens[0]
            for i in range(len(prompts))]


def _streamed(engine, prompts, arrivals: dict) -> dict:
    """Submit arrivals[t] of `prompts` (in order) before step t; step until idle."""
    got, step, submitted = {}, 0, 0
    while step <= max(arrivals) or not engine.idle:
        for _ in range(arrivals.get(step, 0)):
            assert engine.submit(prompt=prompts[submitted]) == submitted
            submitted += 1
        for image in engine.step():
            got[image.index] = image.tokens
        step += 1
    return got


@pytest.mark.parametrize("method", list(OPTIONS))
def test_prompts_of_different_lengths_arriving_at_any_time_give_their_decodes_alone(janus, method, monkeypatch):
    """Janus: a stream of 3 rows with prompts arriving at steps 0, 2 and 3, and a decode at
    concurrency 2, give every image the tokens of its decode alone. While one request runs, the
    stream's target passes go over its row alone (a view of the adapter's cache)."""
    kw = dict(seed=0, sampling=Sampling(cfg_scale=2.0), backend="reference", **OPTIONS[method])
    fed = []        # the images of the cache each target pass went over
    forward_tokens = janus.target.forward_tokens

    @functools.wraps(forward_tokens)     # (its signature: the runner reads its keywords from it)
    def recorded(cache, *args, **kwargs):
        fed.append(cache.batch)
        return forward_tokens(cache, *args, **kwargs)

    monkeypatch.setattr(janus.target, "forward_tokens", recorded)
    with batch_invariant():
        alone = _alone(janus, method, PROMPTS, **kw)
        fed.clear()
        streamed = _streamed(decoding.stream(method, janus, concurrency=3, **kw), PROMPTS, {0: 1, 2: 2, 3: 1})
        assert fed[0] == 1 and set(fed) <= {1, 2, 3}
        together = decoding.decode(method, janus, prompts=PROMPTS, concurrency=2, **kw).tokens
    for i, tokens in enumerate(alone):
        assert torch.equal(streamed[i], tokens), f"image {i} (stream)"
        assert torch.equal(together[i], tokens), f"image {i} (concurrency 2)"


def test_a_stream_checks_each_request_when_it_is_submitted(janus):
    """A class id for a text-conditional family, a prompt past `max_prompt_len` and token ids
    outside the vocabulary are refused by `submit`, naming what is wrong; the stream serves on."""
    engine = decoding.stream("ar", janus, concurrency=2, seed=0, backend="reference")
    with pytest.raises(ValueError, match="text-conditional: submit a prompt"):
        engine.submit(3)
    with pytest.raises(ValueError, match="max_prompt_len=12"):
        engine.submit(prompt=torch.tensor([BOS] + [5] * 12 + [BOI]))
    with pytest.raises(ValueError, match="outside"):
        engine.submit(prompt=torch.tensor([BOS, 10_000, BOI]))
    assert engine.queue == type(engine.queue)() and engine.submit(prompt=PROMPTS[1]) == 0
    assert [image.index for image in engine.results()] == [0]


def test_glm_image_prompts_of_different_lengths_at_any_concurrency():
    """GLM-Image, prompts of three lengths: two stages (the preview by ar, the target by sjd) and
    MuLo-SD drafted by the preview stage, at concurrency 2, give each image its decode alone; so
    does a stream of MuLo-SD with requests arriving at two steps. A method that needs two stages
    is refused by `stream` (`decode` runs them)."""
    grid, preview = (4, 3), (3, 2)
    fam = hf.wrap(tiny_glm_image(seed=0), grid=grid, preview_grid=preview, max_prompt_len=32)
    prompts = [prompt_ids(text, grid, preview) for text in ("abcd", "fedcbaabkl", "ab")]
    kw = dict(seed=5, backend="reference")
    with batch_invariant():
        for method, options in (("sjd", dict(window=3)), ("mulo", dict(k=8))):
            alone = _alone(fam, method, prompts, **kw, **options)
            together = decoding.decode(method, fam, prompts=prompts, concurrency=2, **kw, **options).tokens
            assert all(torch.equal(together[i], a) for i, a in enumerate(alone)), method
        streamed = _streamed(decoding.stream("mulo", fam, concurrency=2, k=8, **kw), prompts, {0: 1, 1: 2})
    alone = _alone(fam, "mulo", prompts, k=8, **kw)
    assert all(torch.equal(streamed[i], a) for i, a in enumerate(alone))
    with pytest.raises(ValueError, match="two stages"):
        decoding.stream("ar", fam, concurrency=2)
