"""Tiny random models for the decoder tests (no weights needed, fast on a CPU)."""
import pytest
import torch

from specdec import decoding
from specdec.decoding import sd, sjd, ssd
from specdec.decoding.runner import ModelRunner
from specdec.models import GPTConfig, LlamaGenGPT
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.profiling import count_host_syncs


def tiny_gpt(grid, vocab: int = 16, *, seed: int = 0, dim: int = 32, layers: int = 2, classes: int = 3,
             scale: float = 0.5) -> LlamaGenGPT:
    """A random LlamaGen-style GPT whose logits are far from uniform (weights ~ N(0, scale)), on a
    grid of `grid` tokens per side or of (H, W)."""
    H, W = (grid, grid) if isinstance(grid, int) else grid
    g = torch.Generator().manual_seed(seed)
    m = LlamaGenGPT(GPTConfig(vocab_size=vocab, dim=dim, n_layer=layers, n_head=2, multiple_of=16,
                              num_classes=classes, grid_size=H, grid_width=None if W == H else W))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return m.eval()


def tiny_heads(dim: int = 32, *, width: int = 4, seed: int = 0, vertical: int = 1) -> SSDHeads:
    torch.manual_seed(seed)
    return SSDHeads(SSDHeadsConfig(dim, width, n_horizontal=5, n_vertical=vertical, ffn_hidden=2 * dim)).eval()


def lossless_decode(method: str, target, classes, run):
    """`sd` (drafted by a second tiny GPT), `sjd` (window 4) or exact SSD (unbounded
    commit="verify") on a tiny square-grid target: the decodes the distribution tests compare."""
    side, vocab = target.grid[1], target.vocab_size
    if method == "sd":
        return sd.decode(target, classes, drafter=tiny_gpt(side, vocab, seed=4, dim=16, layers=1, scale=0.6),
                         options=sd.SDOptions(chunk=3), run=run)
    if method == "sjd":
        return sjd.decode(target, classes, options=sjd.SJDOptions(window=4), run=run)
    return ssd.decode(target, classes, heads=tiny_heads(16, width=side, seed=5),
                      options=ssd.SSDOptions(rounds=1, chunk=3, max_tail=None, final_passes=None), run=run)


class TinyTokenizer(torch.nn.Module):
    """A stand-in VQ: code v decodes to a constant 2x2 patch of brightness v / (V - 1); encode inverts it."""

    downsample = 2

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)
        g = torch.Generator().manual_seed(7)
        self.codebook = torch.randn(vocab, 4, generator=g)

    @property
    def codebook_size(self):
        return self.vocab

    def decode(self, codes):
        v = codes.float() / (self.vocab - 1) * 2 - 1
        return v.repeat_interleave(2, -1).repeat_interleave(2, -2)[:, None]

    def encode(self, images):
        pooled = torch.nn.functional.avg_pool2d(images, 2)[:, 0]
        return ((pooled + 1) / 2 * (self.vocab - 1)).round().long().clamp(0, self.vocab - 1)


class TinyFamily:
    """The fields `specdec.decoding.decode` and the CLI use, on tiny random models: a 4x4 target
    (or `grid` (H, W), even sides), a low-resolution drafter at half the grid (r = 2), a smaller
    same-grid drafter, SSD heads (two vertical), a stand-in tokenizer and a random evaluator."""

    class_names = ("a", "b", "c")

    def __init__(self, vocab: int = 16, seed: int = 0, grid=(4, 4)):
        from specdec.models.evaluator import FashionClassifier, QualityEvaluator

        H, W = grid
        self.target = tiny_gpt((H, W), vocab, seed=seed)
        self.drafter = tiny_gpt((H // 2, W // 2), vocab, seed=seed + 1)
        self.sd_drafter = tiny_gpt((H, W), vocab, seed=seed + 3, dim=16, layers=1)
        self.ssd_heads = tiny_heads(32, width=W, seed=seed + 2, vertical=2)
        self.tokenizer = TinyTokenizer(vocab)
        self.codebook = self.tokenizer.codebook
        from specdec.models.upsampler import TokenUpsampler

        torch.manual_seed(seed)
        self.upsampler = TokenUpsampler(vocab, self.codebook.shape[1], factor=2, channels=8).eval()
        with torch.no_grad():
            self.upsampler.codebook.copy_(self.codebook)
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        self.evaluator = QualityEvaluator(FashionClassifier(3), torch.randn(64, 128, generator=g),
                                          torch.randn(60, 128, generator=g), torch.arange(60) % 3)


def decode_alone(fam, method, classes, options, **kw) -> list:
    """Each image of `classes` decoded on its own (a batch of one), image i from stream i: what a
    batched or continuous decode of image i must give."""
    return [decoding.decode(method, fam, classes[i:i + 1], first_index=i, **options, **kw) for i in range(len(classes))]


def submit_staggered(engine, classes, arrivals: dict) -> dict:
    """Drive a continuous engine as a server would: before engine step t, submit arrivals[t] of
    `classes` (in order; image i gets index i), step until idle; returns {index: Finished}."""
    got, step, submitted = {}, 0, 0
    while step <= max(arrivals) or not engine.idle:
        for _ in range(arrivals.get(step, 0)):
            assert engine.submit(classes[submitted]) == submitted
            submitted += 1
        for image in engine.step():
            got[image.index] = image
        step += 1
    assert sorted(got) == list(range(len(classes)))
    return got


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tiny models are latency-bound: one intra-op thread avoids OpenMP spin-waits, which cost
    100x on a loaded 2-core machine. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class LoopCounter:
    """Counts a decode's host round trips, less those of its per-batch set-up (the argument checks
    at the API boundary and the model's checks in each prefill, target's and drafter's, which run
    once per batch and not per pass, and `also`: more (owner, name) set-up such as a tokenizer's
    checks when the images are made), and its target passes (a batched pass counts once)."""

    def __init__(self, monkeypatch, target, also=()):
        from specdec.decoding import batching

        self.setup, self.passes, self.count = 0, 0, None
        for owner, name in ((batching, "check_classes"), (ModelRunner, "prefill"), *also):
            monkeypatch.setattr(owner, name, self._setup(getattr(owner, name)))
        forward = ModelRunner.forward

        def counted(runner, *args, **kwargs):
            self.passes += runner.model is target
            return forward(runner, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", counted)
        prefill = ModelRunner.prefill

        def counted_prefill(runner, *args, **kwargs):
            self.passes += runner.model is target
            return prefill(runner, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "prefill", counted_prefill)

    def _setup(self, fn):
        def excluded(*args, **kwargs):
            before = self.count.round_trips
            try:
                return fn(*args, **kwargs)
            finally:
                self.setup += self.count.round_trips - before
        return excluded

    def decode(self, *args, **kwargs):
        with count_host_syncs() as self.count:
            out = decoding.decode(*args, **kwargs)
        return out, self.count.round_trips - self.setup
