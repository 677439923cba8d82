"""Quality columns of the comparison table: class accuracy and FD-classifier (never called FID)
from the evaluator shipped with the model family (specdec.models.evaluator)."""
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
