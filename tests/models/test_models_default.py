"""The shipped default family: it loads with no data set and no network, and its AR samples
show the requested Fashion-MNIST classes (class accuracy under the shipped evaluator)."""
import pytest
import torch
import torch.nn.functional as F

from specdec.models import ARImageModel, default, sample_ar

# Measured on 500 samples (50 per class, CFG 2, seed 0; docs/models.md, "Quality of the family"): target 0.68, drafter
# 0.656, SSD +1 head argmax agreement 0.656 and +W 0.523 (held out). The tests draw 40 samples,
# so the floors sit about 3.5 standard deviations below the measurements (chance is 0.1 / 1/V).
TARGET_ACCURACY_FLOOR = 0.40
DRAFTER_ACCURACY_FLOOR = 0.35
HEAD_AGREEMENT_FLOOR = 0.30
CFG = 2.0


@pytest.fixture(scope="module")
def family():
    # Batch-1-sized ops: on a busy 2-core machine a second thread only adds waiting (measured
    # 2-3x slower); restored afterwards for the other test modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield default("cpu")
    torch.set_num_threads(threads)


def test_family_loads_without_data(family):
    assert isinstance(family.target, ARImageModel) and isinstance(family.drafter, ARImageModel)
    assert family.target.grid == (16, 16) and family.drafter.grid == (8, 8)
    assert family.target.vocab_size == family.drafter.vocab_size == family.codebook.shape[0]
    assert 256 <= family.codebook.shape[0] <= 1024
    torch.testing.assert_close(family.codebook.norm(dim=-1), torch.ones(family.codebook.shape[0]))
    assert family.target.null_class == 10 and family.drafter.null_class == 10
    assert family.ssd_heads.offsets == (1, 2, 3, 4, 5, 16, 32)
    assert family.evaluator.test_accuracy > 0.85
    assert default("cpu") is family  # loaded once


def test_one_tokenizer_serves_both_resolutions(family):
    images = family.decode(sample_ar(family.target, torch.tensor([1, 8]), cfg_scale=CFG,
                                     generator=torch.Generator().manual_seed(1)))
    low = family.tokenizer.encode(F.avg_pool2d(images, 2))
    assert low.shape == (2, 8, 8)
    assert family.decode(low).shape == (2, 1, 16, 16)


def test_ar_samples_show_the_requested_classes(family):
    classes = torch.arange(10).repeat(4)
    tokens = sample_ar(family.target, classes, cfg_scale=CFG, generator=torch.Generator().manual_seed(0))
    report = family.evaluator.evaluate(family.decode(tokens), classes)
    assert report.class_accuracy >= TARGET_ACCURACY_FLOOR, report   # chance is 0.1


def test_drafter_samples_show_the_requested_classes(family):
    classes = torch.arange(10).repeat(4)
    tokens = sample_ar(family.drafter, classes, cfg_scale=CFG, generator=torch.Generator().manual_seed(0))
    images = F.interpolate(family.decode(tokens), size=(32, 32), mode="bilinear", align_corners=False)
    report = family.evaluator.evaluate(images, classes)
    assert report.class_accuracy >= DRAFTER_ACCURACY_FLOOR, report


def test_ssd_heads_predict_the_target(family):
    """The +1 head's draft token agrees with the target's own argmax far above chance (1/V)."""
    target, heads = family.target, family.ssd_heads
    classes = torch.arange(10)
    tokens = sample_ar(target, classes, cfg_scale=CFG, generator=torch.Generator().manual_seed(2)).flatten(1)
    with torch.no_grad():
        hidden = target.teacher_forward(tokens[:, :-1], classes).hidden[:, target.prefix_len - 1:]
        t = torch.arange(0, 200)
        pred = heads.predict_horizontal(hidden[:, t], target.embed_tokens(tokens[:, t]))[..., 0, :]
        agree = (target.head(pred).argmax(-1) == target.head(hidden[:, t + 1]).argmax(-1)).float().mean()
        below = heads.predict_vertical(hidden[:, t], target.embed_tokens(tokens[:, t]))[..., 0, :]
        agree_v = (target.head(below).argmax(-1) == target.head(hidden[:, t + 16]).argmax(-1)).float().mean()
    assert agree >= HEAD_AGREEMENT_FLOOR and agree_v >= HEAD_AGREEMENT_FLOOR, (agree, agree_v)
