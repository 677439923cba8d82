"""Exact mode (`RunSettings.exact`): every token is drawn with noise keyed by (seed, image index,
raster position), drafts are kept only where they equal the target's own token, so `sd`'s and
`sjd`'s images are `ar`'s bit for bit, whatever their draft lengths, windows, batch, concurrency,
arrival order or token budget (reference backend under `batch_invariant()`)."""
import pytest
import torch

from decoding_models import TinyFamily, single_thread, submit_staggered  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.models import default
from specdec.decoding import widths
from specdec.numerics import batch_invariant
from specdec.settings import Sampling

SAMPLING = Sampling(cfg_scale=2.0)
#: exact variants: sd's draft lengths (a drafter model; SSD's heads drafting too) and sjd's windows
EXACT = [("sd", dict(chunk=c)) for c in (1, 2, 4, 8)] + [("sd", dict(chunk=2, heads="family"))] + \
        [("sjd", dict(window=w)) for w in (3, 8)]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for m, o in EXACT]
#: how a run is batched: one image at a time, a lockstep batch, rows refilled as images finish,
#: and the tightest token budget (a share of one token: plain AR steps)
LOADS = {"batch1": dict(batch_size=1), "batch16": dict(batch_size=16), "concurrency5": dict(concurrency=5),
         "budget": dict(concurrency=4, max_tokens_per_pass=4)}
#: fixed widths (the options' own) unless a test says otherwise: the width rule, on by default in
#: exact mode, takes plain AR steps on this compute-bound CPU
FIXED = dict(adaptive_width=False)


@pytest.fixture(scope="module")
def fam():
    return TinyFamily(grid=(6, 6))


def _options(fam, options):
    return dict(options, heads=fam.ssd_heads) if options.get("heads") == "family" else options


def _decode(fam, method, classes, **kw):
    with batch_invariant():
        return decoding.decode(method, fam, classes, seed=5, sampling=SAMPLING, backend="reference", exact=True, **kw)


@pytest.fixture(scope="module")
def classes():
    return torch.arange(24) % 3


@pytest.fixture(scope="module")
def ar_tokens(fam, classes):
    return _decode(fam, "ar", classes, batch_size=24).tokens


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("method,options", EXACT, ids=IDS)
def test_exact_speculation_gives_ar_s_image(fam, classes, ar_tokens, method, options, load):
    n = 6 if load == "batch1" else len(classes)     # (one image at a time: fewer of them)
    out = _decode(fam, method, classes[:n], **LOADS[load], **FIXED, **_options(fam, options))
    assert torch.equal(out.tokens, ar_tokens[:n])
    if load != "budget":     # (speculation, not AR steps: some drafts were kept)
        assert out.stats.target_forwards_per_image < 36


@pytest.mark.parametrize("method,options", [("sd", dict(chunk=4)), ("sjd", dict(window=8))], ids=["sd", "sjd"])
def test_exact_requests_arriving_while_others_run_give_ar_s_image(fam, classes, ar_tokens, method, options):
    with batch_invariant():
        engine = decoding.stream(method, fam, concurrency=5, seed=5, sampling=SAMPLING, backend="reference",
                                 exact=True, **options)
        got = submit_staggered(engine, classes[:12].tolist(), {0: 3, 2: 4, 5: 1, 9: 4})
    for i in range(12):
        assert torch.equal(got[i].tokens, ar_tokens[i]), f"image {i}"


def test_an_exact_image_depends_on_its_seed_and_index_alone(fam, classes, ar_tokens):
    """Image i of seed s is the same as the i-th of a longer run, and a request's own seed gives
    the image of that seed's run; exact `ar` is not the default `ar` (other noise)."""
    later = _decode(fam, "sd", classes[10:14], first_index=10, batch_size=2, chunk=3)
    assert torch.equal(later.tokens, ar_tokens[10:14])
    with batch_invariant():
        engine = decoding.stream("sjd", fam, concurrency=2, seed=5, sampling=SAMPLING, backend="reference",
                                 exact=True, window=4)
        engine.submit(int(classes[1]), index=1, seed=9)
        got = list(engine.results())
        alone = decoding.decode("ar", fam, classes[:2], seed=9, sampling=SAMPLING, backend="reference",
                                exact=True, batch_size=2)
    assert torch.equal(got[0].tokens, alone.tokens[1])
    with batch_invariant():
        default_ar = decoding.decode("ar", fam, classes[:4], seed=5, sampling=SAMPLING, backend="reference",
                                     batch_size=4)
    assert not torch.equal(default_ar.tokens, ar_tokens[:4])


@pytest.mark.parametrize("method", ["lantern", "zipar", "mulo", "ssd"])
def test_a_lossy_method_cannot_be_exact(fam, method):
    assert method not in decoding.EXACT_METHODS     # (the name the docs and the server use)
    with pytest.raises(ValueError, match=f"exact: {method} is not lossless"):
        decoding.decode(method, fam, [0], exact=True)


def test_exact_compiled_decodes_match_eager(fam, classes):
    """The position-keyed draw inside compiled steps and passes (its fake implementation traced)."""
    kw = dict(seed=5, sampling=SAMPLING, backend="cpu", exact=True, batch_size=4)
    for method, options in [("ar", {}), ("sd", dict(chunk=4))]:
        eager = decoding.decode(method, fam, classes[:4], **kw, **options)
        compiled = decoding.decode(method, fam, classes[:4], compile=True, **kw, **options)
        assert torch.equal(compiled.tokens, eager.tokens), method


def test_exact_sd_and_sjd_give_ar_s_image_on_the_16x16_family():
    """The embedded family (16x16 tokens, a trained target and drafter): eight images."""
    fam16, classes = default(), torch.arange(8)
    kw = dict(seed=2, backend="reference", exact=True)
    with batch_invariant():
        ar = decoding.decode("ar", fam16, classes, batch_size=8, **kw).tokens
        for method, run in [("sd", dict(batch_size=8, chunk=4)), ("sd", dict(concurrency=5, chunk=8)),
                            ("sjd", dict(batch_size=8, window=16))]:
            out = decoding.decode(method, fam16, classes, **kw, **run)
            assert torch.equal(out.tokens, ar), (method, run)


# ---- widths that follow the load ------------------------------------------------------------

def test_the_width_rule_goes_wide_where_a_pass_costs_the_same_and_narrow_where_it_costs_its_tokens():
    flat = widths.Widths(8, widths.PassCost(1.0, 0.0))
    assert flat.choose(1) == flat.choose(64) == 8
    per_token = widths.Widths(8, widths.PassCost(0.0, 1.0))
    assert per_token.choose(1) == 0
    mixed = widths.Widths(8, widths.PassCost(1.0, 0.05))
    assert mixed.choose(1) > mixed.choose(16) > mixed.choose(64) == 0
    drafted = widths.Widths(8, widths.PassCost(1.0, 0.0), drafter=widths.PassCost(1.0, 0.0))
    assert drafted.choose(4) < 8      # (each draft costs a drafter pass)
    window = widths.Widths(8, widths.PassCost(1.0, 0.05), all_or_none=True)     # (sjd's)
    assert window.choose(1) == 8 and window.choose(64) == 0


def test_the_width_rule_learns_the_acceptance_per_offset():
    rule = widths.Widths(3, widths.PassCost(1.0, 0.0))
    assert rule.acceptance == [0.5, 0.5, 0.5]
    rule.observe([[True, False, True], [False, True, True], [True, True, True]], [3, 3, 2])
    # offset 0: 3 reached, 2 kept; offset 1: 2 reached, 1 kept; offset 2: 0 reached (row 2 judged 2)
    assert rule.acceptance == [3 / 5, 2 / 4, 1 / 2]
    assert widths.expected_commits([0.5, 0.5], 2) == 1 + 0.5 + 0.25


def test_a_pass_cost_is_measured_once_on_the_runner_and_leaves_its_cache_empty(fam):
    from specdec.decoding.runner import ModelRunner

    runner = ModelRunner(fam.target, SAMPLING, batch=3)
    cost = widths.measure_pass_cost(runner, 5)
    assert cost.fixed >= 0 and cost.per_token >= 0 and cost(10) >= cost(1)
    assert runner.forwards == 0 and not bool(runner.cache.valid.any())
    assert widths.measure_pass_cost(runner, 5) is cost


def test_a_pass_cost_takes_the_fastest_of_passes_that_take_turns(monkeypatch):
    """A noisy machine only adds time: each width's cost is its fastest pass, and the widths take
    turns, so that drift falls on both (a slow spell over the first passes would make one width
    look dear and the other cheap)."""
    class Runner:
        batch, device = 2, torch.device("cpu")
        fed = []

        def forward(self, tokens, positions):
            self.fed.append(tokens.shape[1])
    clock = iter([0.0, 10.0] + [t for k in range(10) for t in (20 + 10 * k, 21 + 10 * k + k % 3,
                                                               25 + 10 * k, 28 + 10 * k)])
    monkeypatch.setattr(widths.time, "perf_counter", lambda: next(clock))
    assert widths._time_passes(Runner(), (1, 5)) == [1.0, 3.0]      # (width 1: 1, 2 or 3 s a pass)
    assert Runner.fed == [1, 5] * 11


@pytest.mark.parametrize("method,options,per_token", [("sd", dict(chunk=4), 0.3), ("sjd", dict(window=8), 0.05)],
                         ids=["sd", "sjd"])
def test_widths_that_change_with_the_load_keep_ar_s_image(fam, classes, ar_tokens, monkeypatch, method, options,
                                                          per_token):
    """A pass cost between flat and per-token: wide while one or two rows run, plain AR steps
    while five do (sjd: its whole window or none); the images are still `ar`'s."""
    monkeypatch.setattr(widths, "measure_pass_cost", lambda runner, widest: (    # (drafts cost nothing)
        widths.PassCost(1.0, per_token) if runner.model is fam.target else widths.PassCost(0.0, 0.0)))
    chosen = []
    choose = widths.Widths.choose
    monkeypatch.setattr(widths.Widths, "choose", lambda self, rows: chosen.append(choose(self, rows)) or chosen[-1])
    with batch_invariant():
        engine = decoding.stream(method, fam, concurrency=5, seed=5, sampling=SAMPLING, backend="reference",
                                 exact=True, **options)
        got = submit_staggered(engine, classes[:9].tolist(), {0: 1, 6: 4, 8: 4})
    assert 0 in chosen and max(chosen) >= 1
    for i in range(9):
        assert torch.equal(got[i].tokens, ar_tokens[i]), f"image {i}"
