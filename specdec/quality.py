"""Quality columns of the comparison table: class accuracy and FD-classifier (never called FID)
from the evaluator shipped with the model family (specdec.models.evaluator); and a check of a
decoder's faithfulness to the target that needs no evaluator (`likelihood_excess`)."""
from __future__ import annotations

from typing import Optional

import torch


def evaluate(evaluator, images: Optional[torch.Tensor], classes: torch.Tensor) -> dict:
    """{"class_accuracy", "fd", "fd_real"} for generated images [N, C, h, w] of the requested classes.
    FD needs >= 2 images; with fewer (or no evaluator / images) the entries are None."""
    empty = {"class_accuracy": None, "fd": None, "fd_real": None}
    if evaluator is None or images is None or images.shape[0] < 2:
        return empty
    report = evaluator.evaluate(images, torch.as_tensor(classes))
    return {"class_accuracy": report.class_accuracy, "fd": report.fd_classifier, "fd_real": report.fd_real_vs_real}


@torch.no_grad()
def likelihood_excess(target, tokens: torch.Tensor, classes, sampling, *, batch_size: int = 64) -> dict:
    """How far the tokens of a decoder stray from the target's own sampling distribution.

    Teacher-forces the grids `tokens` [N, H, W] (or [N, H*W]) of `classes` through the target at
    `sampling` (CFG, temperature, top-k) and, at every position, takes -log p(x) of the token
    there minus the entropy of p, where p is the target's distribution given the tokens before it.
    A token drawn from p has an expected excess of exactly 0, whatever its context; so an exact
    decoder (ar, sd, ...) scores 0 up to noise, and a lossy one shows by how much, and where.
    Positive: tokens less likely than the target's own draws would be (e.g. committed under a stale
    context); negative: more likely (e.g. sharpened towards the mode).

    Returns {"mean": nats per token, "stderr": its standard error over images, "per_row": the
    mean for each token row (H floats)}."""
    from specdec.ops.checks import read_back
    from specdec.decoding.batching import check_classes, check_grid_model
    from specdec.decoding.runner import ModelRunner

    check_grid_model(target, "target")
    classes = check_classes(target, classes)
    H, W = target.grid
    if not isinstance(tokens, torch.Tensor) or tokens.numel() != classes.shape[0] * H * W:
        raise ValueError(f"tokens must hold {classes.shape[0]} grids of {H}x{W} (one per class), got "
                         f"{None if not isinstance(tokens, torch.Tensor) else tuple(tokens.shape)}")
    tokens = tokens.reshape(-1, H * W).long()
    lo, hi = read_back(*torch.aminmax(tokens))
    if lo < 0 or hi >= target.vocab_size:
        raise ValueError(f"tokens must lie in [0, {target.vocab_size})")
    per_image = []
    for start in range(0, tokens.shape[0], batch_size):
        x, cls = tokens[start:start + batch_size], classes[start:start + batch_size]
        runner = ModelRunner(target, sampling, batch=x.shape[0])
        p0 = runner.probs(runner.prefill(cls))                                   # token 0
        rest = runner.probs(runner.forward(x[:, :-1], torch.arange(H * W - 1)))  # tokens 1 ..
        p = torch.cat([p0, rest], 1).double()                                    # [b, HW, V]
        logp = p.clamp_min(1e-300).log()
        entropy = -(p * logp).sum(-1)
        per_image.append((-logp.gather(2, x.to(p.device)[..., None])[..., 0] - entropy).cpu())
    excess = torch.cat(per_image).view(-1, H, W)
    by_image = excess.mean((1, 2))
    n = by_image.shape[0]
    return {"mean": float(by_image.mean()),
            "stderr": float(by_image.std() / n ** 0.5) if n > 1 else float("nan"),
            "per_row": excess.mean((0, 2)).tolist()}
