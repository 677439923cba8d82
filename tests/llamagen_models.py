"""Tiny random LlamaGen models (class-conditional state dicts, text-to-image models) and caption
features, in LlamaGen's own key names and T5's output layout (shared by tests/models/ and
tests/cli/)."""
import torch

from specdec.models import LlamaGenGPT
from specdec.models.loaders import llamagen_gpt_config

TINY = {"n_layer": 2, "n_head": 2, "dim": 32, "multiple_of": 16}
CAPTION_DIM, SLOTS, VOCAB, GRID = 12, 8, 16, 4


def random_llamagen_state(seed=0, vocab=40, classes=5, grid=4):
    """A random class-conditional LlamaGen GPT state dict (TINY's shape)."""
    torch.manual_seed(seed)
    model = LlamaGenGPT(llamagen_gpt_config(TINY, vocab_size=vocab, num_classes=classes, grid_size=grid))
    return {k: torch.randn_like(v) * 0.3 for k, v in model.state_dict().items()}


def tiny_t2i(grid=GRID, *, seed=0, dim=32, layers=2, scale=0.5) -> LlamaGenGPT:
    """A random t2i GPT whose logits are far from uniform; uncond_embedding random too."""
    g = torch.Generator().manual_seed(seed)
    cfg = llamagen_gpt_config(dict(TINY, dim=dim, n_layer=layers), vocab_size=VOCAB, grid_size=grid,
                              model_type="t2i", caption_dim=CAPTION_DIM, caption_slots=SLOTS)
    m = LlamaGenGPT(cfg)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.copy_(torch.randn(t.shape, generator=g) * scale)
    return m.eval()


def captions(lengths, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(n, CAPTION_DIM, generator=g) for n in lengths]


# ---- the released t2i size and upstream's key names -------------------------------------------


def upstream_t2i_state(seed=0, grid=GRID):
    """A random state dict written key by key with the names of LlamaGen's t2i Transformer."""
    g = torch.Generator().manual_seed(seed)
    D, hidden = TINY["dim"], 96   # SwiGLU hidden: find_multiple(int(2 * 4 * 32 / 3), 16) = 96
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.5   # noqa: E731
    state = {"tok_embeddings.weight": r(VOCAB, D), "norm.weight": r(D), "output.weight": r(VOCAB, D),
             "cls_embedding.cap_proj.fc1.weight": r(D, CAPTION_DIM), "cls_embedding.cap_proj.fc2.weight": r(D, D),
             "cls_embedding.uncond_embedding": r(SLOTS, CAPTION_DIM)}
    for i in range(TINY["n_layer"]):
        p = f"layers.{i}."
        state.update({p + "attention.wqkv.weight": r(3 * D, D), p + "attention.wo.weight": r(D, D),
                      p + "feed_forward.w1.weight": r(hidden, D), p + "feed_forward.w3.weight": r(hidden, D),
                      p + "feed_forward.w2.weight": r(D, hidden), p + "attention_norm.weight": r(D),
                      p + "ffn_norm.weight": r(D)})
    return state


def t5_style(caps):
    """Captions as T5 returns them: right-padded to the slot count (garbage after the end) + mask."""
    embs = torch.randn(len(caps), SLOTS, CAPTION_DIM) * 3
    masks = torch.zeros(len(caps), SLOTS)
    for i, c in enumerate(caps):
        embs[i, :c.shape[0]] = c
        masks[i, :c.shape[0]] = 1
    return embs, masks
