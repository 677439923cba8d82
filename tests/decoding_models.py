"""Tiny random models for the decoder tests (no weights needed, fast on a CPU)."""
import pytest
import torch

from specdec.models import GPTConfig, LlamaGenGPT
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig


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


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tiny models are latency-bound: one intra-op thread avoids OpenMP spin-waits, which cost
    100x on a loaded 2-core machine. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
