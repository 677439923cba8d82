"""FD-classifier arithmetic and the evaluator's bookkeeping (no trained weights needed)."""
import pytest
import torch

from specdec.models.evaluator import FashionClassifier, QualityEvaluator, frechet_distance, gaussian_stats


def test_frechet_distance_of_diagonal_gaussians_has_the_closed_form():
    torch.manual_seed(0)
    mu1, mu2 = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    v1, v2 = torch.rand(6, dtype=torch.float64) + 0.1, torch.rand(6, dtype=torch.float64) + 0.1
    expected = float(((mu1 - mu2) ** 2).sum() + (v1 + v2 - 2 * (v1 * v2).sqrt()).sum())
    assert frechet_distance(mu1, torch.diag(v1), mu2, torch.diag(v2)) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_is_invariant_to_a_common_rotation():
    torch.manual_seed(1)
    a, b = torch.randn(200, 5, dtype=torch.float64), torch.randn(200, 5, dtype=torch.float64) * 1.5 + 0.3
    rot, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    d0 = frechet_distance(*gaussian_stats(a), *gaussian_stats(b))
    d1 = frechet_distance(*gaussian_stats(a @ rot), *gaussian_stats(b @ rot))
    assert d0 == pytest.approx(d1, rel=1e-8) and d0 > 0.1
    assert frechet_distance(*gaussian_stats(a), *gaussian_stats(a)) == pytest.approx(0.0, abs=1e-8)


def _evaluator():
    torch.manual_seed(0)
    clf = FashionClassifier().eval()
    pool_labels = torch.arange(400) % 10
    return QualityEvaluator(clf, torch.randn(50, 128).abs(), torch.randn(400, 128).abs(), pool_labels)


def test_evaluate_reports_accuracy_against_the_classifier():
    ev = _evaluator()
    images = torch.rand(12, 1, 32, 32) * 2 - 1
    predicted = ev.classifier(images).argmax(-1)
    rep = ev.evaluate(images, predicted)
    assert rep.class_accuracy == 1.0 and rep.n == 12
    rep = ev.evaluate(images, (predicted + 1) % 10)
    assert rep.class_accuracy == 0.0
    assert rep.fd_classifier >= 0 and rep.fd_real_vs_real >= 0


def test_28px_images_are_padded_like_training_images():
    clf = _evaluator().classifier
    x = torch.rand(3, 1, 28, 28)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), value=-1.0)
    torch.testing.assert_close(clf.features(x), clf.features(padded))


def test_real_floor_needs_enough_real_images():
    with pytest.raises(ValueError, match="class 3"):
        _evaluator().real_floor(torch.full((41,), 3))
