"""The shipped 32x32-token family (`default(grid=32)`, 64x64 px): it loads offline, every method
decodes its grid in batches, MuLo-SD drafts it with the 16x16 target, and a batch gives each image
the tokens it gets alone (batch-invariant numerics; the C++ kernels, which compute each row alone)
for ar, mulo and ssd, and the speculative loops keep the engine's budget of host round trips at
1,024 tokens."""
import pytest
import torch

from decoding_models import LoopCounter
from specdec import decoding
from specdec.models import ARImageModel, default, sample_ar
from specdec.numerics import batch_invariant
from specdec.settings import Sampling

CLASSES = torch.tensor([7, 1])
SAMPLING = Sampling(cfg_scale=2.0)


@pytest.fixture(scope="module")
def family():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # batch-1-sized ops: a second thread only waits on a busy 2-core machine
    yield default("cpu", grid=32)
    torch.set_num_threads(threads)


def test_the_32x32_family_loads_offline_with_the_16x16_target_as_its_drafter(family):
    small = default("cpu")
    assert isinstance(family.target, ARImageModel)
    assert family.target.grid == (32, 32) and family.sd_drafter.grid == (32, 32)
    assert family.drafter.grid == (16, 16)               # the 16x16 family's target, weight for weight
    assert all(torch.equal(a, b) for a, b in zip(family.drafter.state_dict().values(),
                                                   small.target.state_dict().values()))
    assert family.tokenizer is not None and torch.equal(family.codebook, small.codebook)
    assert family.ssd_heads.offsets == (1, 2, 3, 4, 5, 32, 64)   # +W and +2W on a 32-wide grid
    assert family.upsampler is not None
    assert default("cpu", grid=32) is family
    with pytest.raises(ValueError, match="grid must be 16 or 32"):
        default("cpu", grid=24)


def test_the_32x32_target_draws_the_requested_classes(family):
    classes = torch.arange(10).repeat(2)
    tokens = sample_ar(family.target, classes, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (20, 32, 32)
    images = family.decode(tokens)
    assert images.shape == (20, 1, 64, 64)
    report = family.evaluator.evaluate(images, classes)
    assert report.class_accuracy >= 0.2, report   # chance is 0.1; 0.42 on 100 images (docs/models.md)


@pytest.mark.parametrize("method", [m for m in decoding.METHODS if m not in ("ar", "mulo", "ssd")])
def test_every_other_method_decodes_the_32x32_grid_in_a_batch(family, method):
    result = decoding.decode(method, family, CLASSES, seed=0, sampling=SAMPLING, batch_size=2)
    assert result.tokens.shape == (2, 32, 32)
    assert int(result.tokens.min()) >= 0 and int(result.tokens.max()) < family.target.vocab_size
    assert result.stats.images == 2 and result.stats.tokens == 2 * 32 * 32
    assert result.stats.target_forwards <= 2 * 32 * 32 + 2


@pytest.mark.parametrize("method", ["ar", "mulo", "ssd"])
def test_a_32x32_batch_gives_each_image_the_tokens_it_gets_alone(family, method):
    with batch_invariant():
        alone = torch.cat([decoding.decode(method, family, CLASSES[i:i + 1], seed=5, first_index=i,
                                           sampling=SAMPLING, backend="cpu").tokens
                           for i in range(len(CLASSES))])
        batched = decoding.decode(method, family, CLASSES, seed=5, sampling=SAMPLING, backend="cpu",
                                  batch_size=2)
    assert batched.tokens.shape == (2, 32, 32)
    assert torch.equal(batched.tokens, alone)
    if method == "mulo":   # drafted by the 16x16 target: far fewer target passes than tokens
        assert batched.stats.draft_forwards > 0
        assert batched.stats.target_forwards < 2 * 32 * 32 / 4


@pytest.mark.parametrize("method", ["mulo", "ssd"])
def test_at_1024_tokens_a_speculative_decode_reads_back_at_most_once_per_target_pass(family, monkeypatch, method):
    # Making the images at the end checks the codes once per batch (VQTokenizer.embed_codes): not the loop's.
    counter = LoopCounter(monkeypatch, family.target, also=[(type(family.tokenizer), "decode")])
    out, round_trips = counter.decode(method, family, CLASSES, seed=1, sampling=SAMPLING, backend="cpu", batch_size=2)
    assert out.tokens.shape == (2, 32, 32)
    assert counter.passes == out.stats.passes_made       # (each pass once, whichever images took it)
    assert max(out.stats.target_passes) <= counter.passes
    assert round_trips <= counter.passes, (round_trips, counter.passes, counter.count.by_op)
