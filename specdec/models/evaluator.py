"""Quality evaluator for generated Fashion-MNIST images: a small CNN classifier.

For a set of generated images with their requested classes it reports
- class accuracy: how often the classifier sees the requested class;
- FD-classifier: the Frechet distance between Gaussian fits of the classifier's penultimate
  features of the generated images and of held-out real images. It is *not* FID (no Inception
  network): compare it only with itself, and with `fd_real_vs_real`, the same distance between
  as many real held-out images and the reference set (the floor set by the sample size).
The reference features of held-out test images ship inside the weights file, so evaluation
needs no data set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURE_DIM = 128


class FashionClassifier(nn.Module):
    """[N, 1, 32, 32] images in [-1, 1] -> class logits [N, 10]; penultimate features [N, 128]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(128 * 4 * 4, FEATURE_DIM)
        self.cls = nn.Linear(FEATURE_DIM, num_classes)

    @staticmethod
    def _prepare(images: torch.Tensor) -> torch.Tensor:
        if images.dim() == 3:
            images = images.unsqueeze(1)
        if images.dim() != 4 or images.shape[1] != 1:
            raise ValueError(f"images must be [N, 1, H, W], got {tuple(images.shape)}")
        if images.shape[-2:] == (28, 28):
            images = F.pad(images, (2, 2, 2, 2), value=-1.0)
        elif images.shape[-2:] != (32, 32):
            images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
        return images.float()

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(self.conv(self._prepare(images)).flatten(1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.cls(self.features(images))


def gaussian_stats(features: torch.Tensor):
    f = features.double()
    mu = f.mean(0)
    centred = f - mu
    return mu, centred.T @ centred / max(1, f.shape[0] - 1)


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(m)
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def frechet_distance(mu1, cov1, mu2, cov2) -> float:
    """||mu1 - mu2||^2 + Tr(C1 + C2 - 2 (C1 C2)^(1/2)), via the symmetric form sqrt(C1) C2 sqrt(C1)."""
    s1 = _sqrt_psd(cov1)
    cross = torch.linalg.eigvalsh(s1 @ cov2 @ s1).clamp_min(0).sqrt().sum()
    return float((mu1 - mu2).square().sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * cross)


@dataclass
class QualityReport:
    n: int
    class_accuracy: float
    fd_classifier: float
    fd_real_vs_real: float

    def __str__(self) -> str:
        return (f"n={self.n} class accuracy {self.class_accuracy:.3f}, FD-classifier {self.fd_classifier:.2f} "
                f"(real vs real at the same n: {self.fd_real_vs_real:.2f})")


class QualityEvaluator:
    """Classifier + reference features of held-out real images (`reference` [R, 128]) and a
    disjoint pool of real features with labels (`pool`, `pool_labels`) for the real-vs-real floor."""

    def __init__(self, classifier: FashionClassifier, reference: torch.Tensor, pool: torch.Tensor,
                 pool_labels: torch.Tensor, test_accuracy: Optional[float] = None):
        self.classifier = classifier.eval()
        self.reference_stats = gaussian_stats(reference)
        self.pool = pool.float()
        self.pool_labels = pool_labels.long()
        self.test_accuracy = test_accuracy

    @torch.no_grad()
    def evaluate(self, images: torch.Tensor, classes: torch.Tensor) -> QualityReport:
        if images.shape[0] != classes.shape[0]:
            raise ValueError(f"{images.shape[0]} images for {classes.shape[0]} classes")
        if images.shape[0] < 2:
            raise ValueError("FD-classifier needs at least 2 images")
        # The classifier lives on the family's device; decoders hand their images back on any.
        device = next(self.classifier.parameters()).device
        feats = torch.cat([self.classifier.features(b.to(device)) for b in images.split(500)])
        acc = (self.classifier.cls(feats).argmax(-1).cpu() == classes.cpu().long()).float().mean().item()
        fd = frechet_distance(*gaussian_stats(feats.cpu()), *self.reference_stats)
        return QualityReport(images.shape[0], acc, fd, self.real_floor(classes))

    def real_floor(self, classes: torch.Tensor) -> float:
        """FD of real pool images with the same class counts as `classes` against the reference."""
        picks = []
        for c, count in zip(*torch.unique(classes.cpu().long(), return_counts=True)):
            idx = (self.pool_labels == c).nonzero().flatten()
            if idx.numel() < count:
                raise ValueError(f"the real pool holds {idx.numel()} images of class {int(c)}, {int(count)} asked")
            picks.append(idx[: int(count)])
        real = self.pool[torch.cat(picks)]
        return frechet_distance(*gaussian_stats(real), *self.reference_stats)
