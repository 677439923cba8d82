"""The decode engine's budget of host round trips on the backends beside the compiled cpu one
(test_engine.py holds the cpu cases): the reference (pure PyTorch) and Triton (in its
interpreter on CPU tensors). The ops' fast path picks its backend once and reads nothing back on
every backend, so a decode reads back at most once per target pass on each; and compile=True
decodes on the reference as it does on the cpu backend."""
import pytest
import torch

from helpers import ar_grid
from decoding_models import LoopCounter, TinyFamily, single_thread  # noqa: F401  (autouse fixture)
from specdec import decoding
from specdec.decoding.runner import ModelRunner
from specdec.decoding.streams import ImageStreams
from specdec.ops import dispatch
from specdec.profiling import count_host_syncs
from specdec.settings import Sampling

SAMPLING = Sampling(cfg_scale=2.0)
CLASSES = torch.tensor([2, 0, 1])
SPECULATIVE = [(m, {}) for m in decoding.METHODS if m != "ar"] + [
    ("ssd", dict(commit="write")),
    ("mulo", dict(resample="raster")),
    ("mulo", dict(drafting="zipar")),
]
IDS = [f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o in SPECULATIVE]
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in dispatch.available_backends(torch.device("cpu")),
    reason="Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)"))]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ar_reads_nothing_back_after_the_prefill(fam, backend):
    runner = ModelRunner(fam.target, SAMPLING, batch=2, backend=backend)
    classes = CLASSES[:2]
    first = runner.prefill(classes)
    with count_host_syncs() as c:
        x = ar_grid(runner, classes, ImageStreams(0, range(2)), start_out=first)
    assert c.round_trips == 0, c.by_op
    assert x.shape == (2, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method,options", SPECULATIVE, ids=IDS)
def test_a_speculative_decode_reads_back_at_most_once_per_target_pass(fam, monkeypatch, backend, method, options):
    counter = LoopCounter(monkeypatch, fam.target)
    out, round_trips = counter.decode(method, fam, CLASSES[:2], seed=4, sampling=SAMPLING, backend=backend,
                                      batch_size=2, **options)
    assert counter.passes == out.stats.passes_made     # a shared pass counted once
    assert round_trips <= counter.passes, (round_trips, counter.passes, counter.count.by_op)


@pytest.mark.parametrize("method,options", [("ar", {}), ("sjd", {}), ("ssd", {}),
                                            ("mulo", dict(upsample="nearest"))], ids=["ar", "sjd", "ssd", "mulo"])
def test_compiled_decodes_on_the_reference_give_the_eager_tokens(fam, method, options):
    """compile=True (fullgraph) with backend="reference": the reference ops trace into the graphs
    as the registered cpu ops do, and the tokens are the eager decode's."""
    kw = dict(seed=5, sampling=SAMPLING, batch_size=2, backend="reference", **options)
    eager = decoding.decode(method, fam, CLASSES[:2], **kw)
    compiled = decoding.decode(method, fam, CLASSES[:2], compile=True, **kw)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert compiled.stats.target_forwards == eager.stats.target_forwards
