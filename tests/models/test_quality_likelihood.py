"""`quality.likelihood_excess`: 0 up to noise for tokens drawn from the target's own distribution,
clearly off for tokens drawn from another one, and clear errors for bad input."""
import pytest
import torch

from decoding_models import tiny_gpt, single_thread  # noqa: F401  (autouse fixture)
from specdec import quality
from specdec.decoding import ar
from specdec.settings import RunSettings, Sampling

N = 400
CLASSES = torch.arange(N) % 3
SAMPLING = Sampling(cfg_scale=1.5)


@pytest.fixture(scope="module")
def target():
    return tiny_gpt(4, 16, seed=5)


def _excess_of_ar_at(target, temperature, seed):
    tokens = ar.decode(target, CLASSES,
                       run=RunSettings(seed=seed, batch_size=N,
                                       sampling=Sampling(cfg_scale=SAMPLING.cfg_scale, temperature=temperature))).tokens
    return quality.likelihood_excess(target, tokens, CLASSES, SAMPLING, batch_size=128)


@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_from_the_target_score_zero(target, seed):
    r = _excess_of_ar_at(target, 1.0, seed)
    assert r["stderr"] > 0
    assert abs(r["mean"]) < 4 * r["stderr"]
    assert len(r["per_row"]) == 4


def test_hotter_tokens_score_above_zero_and_colder_below(target):
    """Drawn at temperature 1.6 the tokens are less likely than the target's own draws; at 0.5
    more likely. Both are judged at temperature 1."""
    hot, cold = _excess_of_ar_at(target, 1.6, 2), _excess_of_ar_at(target, 0.5, 3)
    assert hot["mean"] > 4 * hot["stderr"]
    assert cold["mean"] < -4 * cold["stderr"]


def test_bad_input_is_named(target):
    tokens = torch.zeros(N, 4, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="tokens must hold"):
        quality.likelihood_excess(target, tokens[:-1], CLASSES, SAMPLING)
    with pytest.raises(ValueError, match="tokens must lie"):
        quality.likelihood_excess(target, tokens + 16, CLASSES, SAMPLING)
    with pytest.raises(ValueError, match="classes"):
        quality.likelihood_excess(target, tokens, CLASSES + 5, SAMPLING)
