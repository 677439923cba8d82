"""Plain autoregressive sampling with the KV cache, CFG batched (the `ar` baseline's core).

One target forward per token; the only Python work per token is the sampling itself.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec.models.protocol import cfg_logits


def sample_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample ids from logits [..., V] with temperature and top-k (0 = all); temperature 0 = argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@torch.no_grad()
def sample_ar(model, classes: torch.Tensor, *, cfg_scale: float = 1.0, temperature: float = 1.0,
              top_k: int = 0, generator: Optional[torch.Generator] = None,
              backend: Optional[str] = None, return_hidden: bool = False):
    """Generate token grids [B, H, W] for class ids [B] with one forward per token.

    CFG (cfg_scale != 1) doubles the batch with the null class and samples from
    uncond + s * (cond - uncond); the sampled token is fed to both halves. With
    `return_hidden`, also the pre-norm hidden states of every fed slot [rows, P + H*W - 1, dim]
    (the prefix slots first), as the SSD heads' self-distillation needs."""
    H, W = model.grid
    use_cfg = cfg_scale != 1.0
    device = model.tok_embeddings.weight.device if hasattr(model, "tok_embeddings") else classes.device
    classes = classes.to(device)
    cache = model.new_cache(classes.shape[0], cfg=use_cfg)
    out = model.prefill(cache, classes, backend=backend)
    hidden = [out.hidden] if return_hidden else None
    tokens = torch.empty(classes.shape[0], H * W, dtype=torch.long, device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    for u in range(H * W):
        logits = out.logits[:, -1]
        if use_cfg:
            logits = cfg_logits(logits, cfg_scale)
        tokens[:, u] = sample_logits(logits, temperature=temperature, top_k=top_k, generator=generator)
        if u + 1 < H * W:
            pos.fill_(u)
            out = model.forward_tokens(cache, tokens[:, u:u + 1], pos, backend=backend)
            if return_hidden:
                hidden.append(out.hidden)
    grid = tokens.view(-1, H, W)
    if return_hidden:
        return grid, torch.cat(hidden, dim=1)
    return grid
