"""Every decoder on CUDA tensors, on the embedded default family: what users run on a GPU box.

The CPU suite runs the decoders on tiny random models; here the trained family moves to the GPU,
where the kernels are compiled Triton and CUDA C++ rather than the CPU backends. The uniforms are
the CPU's, but the GPU's logits differ in their last bits, so tokens cannot be compared with the
CPU's (one flipped draw changes the rest of an image); what must hold is that
the target's logits agree with the CPU's, that every method is deterministic under a seed and
gives valid grids, and that SSD's commit="verify" pass count follows its CPU schedule. And the
decode engine's budget where it matters: `torch.cuda.set_sync_debug_mode` reports every time the
host waits for the GPU (reads, and blocking copies either way), which no CPU test can see.
"""
import contextlib
import warnings

import pytest
import torch

from specdec import decoding
from specdec.decoding.runner import ModelRunner
from specdec.decoding.uploads import to_device
from specdec.models import default

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CLASSES = torch.tensor([3, 7])


@pytest.fixture(scope="module")
def families():
    return default("cpu"), default("cuda")


def test_target_logits_on_cuda_match_the_cpu(families):
    cpu, gpu = families
    g = torch.Generator().manual_seed(0)
    H, W = cpu.target.grid
    tokens = torch.randint(0, cpu.target.vocab_size, (2, H * W), generator=g)
    positions = torch.arange(H * W)

    def teacher_forced_logits(model, device):
        cache = model.new_cache(batch=2, cfg=True, device=device)
        with torch.no_grad():
            model.prefill(cache, CLASSES.to(device))
            out = model.forward_tokens(cache, tokens.to(device), positions.to(device))
        return out.logits.cpu()

    want = teacher_forced_logits(cpu.target, "cpu")
    got = teacher_forced_logits(gpu.target, "cuda")
    rel = (got.double() - want.double()).norm() / want.double().norm()
    assert torch.isfinite(got).all()
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("method,options", [(m, {}) for m in decoding.METHODS] + [("ssd", {"commit": "verify"})],
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_every_method_runs_on_cuda_deterministically(families, method, options):
    _, gpu = families
    a = decoding.decode(method, gpu, CLASSES.cuda(), seed=0, **options)
    b = decoding.decode(method, gpu, CLASSES.cuda(), seed=0, **options)
    H, W = gpu.target.grid
    assert a.tokens.shape == (2, H, W)
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < gpu.target.vocab_size
    assert torch.equal(a.tokens.cpu(), b.tokens.cpu())
    assert torch.isfinite(a.images).all()
    s = a.stats
    assert s.images == 2 and s.tokens == 2 * H * W
    assert 1 <= s.target_forwards_per_image <= H * W + 1


def test_compare_runs_on_cuda(families, tmp_path):
    """`specdec compare --device cuda`: decoders hand images back on the CPU, the evaluator lives
    on the GPU; the table must still fill every column."""
    # `specdec compare` runs specdec.compare.run_compare: the seed and sampling go in one RunSettings
    from specdec.compare import run_compare
    from specdec.settings import RunSettings

    _, gpu = families
    run = RunSettings(seed=0, sampling=decoding.Sampling(cfg_scale=2.0))
    rows, _, _ = run_compare(gpu, ["ar", "mulo"], 4, run, {}, out_dir=str(tmp_path), warmup=False)
    assert [r["method"] for r in rows] == ["ar", "mulo"]
    for r in rows:
        assert 0.0 <= r["class_accuracy"] <= 1.0 and r["fd"] >= 0.0
    assert (tmp_path / "mulo_maps.png").exists()


@contextlib.contextmanager
def _host_waits():
    """The synchronizations of the host with the GPU inside the block, as
    `torch.cuda.set_sync_debug_mode("warn")` reports them (a list of warnings, filled as it runs)."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            found = []
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(before)
            found.extend(w for w in log if "synchroniz" in str(w.message))


def test_host_data_reaches_the_gpu_without_waiting_for_it(monkeypatch):
    """`to_device` (index lists and uniforms, every pass) copies through pinned memory, ordered
    on the stream, with SPECDEC_ASYNC_UPLOADS=1; the plain copy it replaces waits for the GPU's
    queue."""
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", "1")
    busy = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    with _host_waits() as waits:
        busy = busy @ busy                       # queued work the copies must not wait for
        ids = to_device([[1, 2], [3, 4]], "cuda", torch.long)
        u = to_device(torch.tensor([0.25, 0.5]), "cuda")
    assert waits == []
    assert ids.tolist() == [[1, 2], [3, 4]] and u.tolist() == [0.25, 0.5]
    with _host_waits() as waits:
        torch.tensor([1, 2], device="cuda")
    assert len(waits) == 1
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", "0")        # the default: the plain copy
    with _host_waits() as waits:
        to_device([1, 2], "cuda", torch.long)
    assert len(waits) == 1


class _LoopWaits:
    """The host's waits for the GPU inside one method's decode loop (the scheduler's steps), less
    the hand-back of finished images to the CPU (per image, after its last pass) and the prefills'
    model checks (each prefill records its waits in a log of its own, so the loop's log leaves them
    out), beside the target passes (a batched pass counts once) and the schedulers made."""

    def __init__(self, monkeypatch, target):
        from specdec.decoding import scheduler

        self.passes, self.batches, self.loop_waits, self.setup_waits = 0, 0, 0, 0
        prefill, forward = ModelRunner.prefill, ModelRunner.forward
        step, retire, start = scheduler.Scheduler.step, scheduler.Scheduler._retire, scheduler.Scheduler.__init__

        def counted_start(sched, *args, **kwargs):
            self.batches += 1
            start(sched, *args, **kwargs)

        def counted_step(sched):
            with _host_waits() as waits:
                out = step(sched)
            self.loop_waits += len(waits)
            return out

        def uncounted_retire(sched):
            with _host_waits() as waits:
                out = retire(sched)
            self.setup_waits += len(waits)
            return out

        def counted_prefill(runner, *args, **kwargs):
            self.passes += runner.model is target
            with _host_waits() as waits:
                out = prefill(runner, *args, **kwargs)
            self.setup_waits += len(waits)
            return out

        def counted_forward(runner, *args, **kwargs):
            self.passes += runner.model is target
            return forward(runner, *args, **kwargs)

        monkeypatch.setattr(scheduler.Scheduler, "__init__", counted_start)
        monkeypatch.setattr(scheduler.Scheduler, "step", counted_step)
        monkeypatch.setattr(scheduler.Scheduler, "_retire", uncounted_retire)
        monkeypatch.setattr(ModelRunner, "prefill", counted_prefill)
        monkeypatch.setattr(ModelRunner, "forward", counted_forward)


@pytest.mark.parametrize("method", decoding.METHODS)
def test_a_decode_on_cuda_waits_for_the_gpu_at_most_once_per_target_pass(families, monkeypatch, method):
    """The engine's host round-trip budget on CUDA, as the GPU sees it: `ar` never waits once its
    prefill is done, every speculative method at most once per target pass (its loop-control
    read), at batch 2. A blocking copy of an index list or of uniforms to the GPU would count, so
    this holds with the asynchronous uploads (SPECDEC_ASYNC_UPLOADS=1, opt-in until this has run)."""
    monkeypatch.setenv("SPECDEC_ASYNC_UPLOADS", "1")
    _, gpu = families
    counter = _LoopWaits(monkeypatch, gpu.target)
    out = decoding.decode(method, gpu, CLASSES.cuda(), seed=0, batch_size=2)
    assert counter.batches == 1
    if method == "ar":                  # its token steps are not ModelRunner passes
        assert counter.loop_waits == 0
        return
    assert counter.passes == out.stats.passes_made
    assert counter.loop_waits <= counter.passes, (counter.loop_waits, counter.passes)


@pytest.mark.parametrize("graphs", ["0", "1"])
@pytest.mark.parametrize("method", ["ar", "mulo", "ssd"])
def test_continuous_batching_runs_on_cuda_compiled(families, monkeypatch, method, graphs):
    """Continuous batching on CUDA, compiled, its batched passes with and without CUDA graphs
    (SPECDEC_CONTINUOUS_GRAPHS, opt-in until this has run): deterministic, every image in the
    passes it takes alone, and tokens in range. Four images in three rows: one joins a running batch."""
    monkeypatch.setenv("SPECDEC_CONTINUOUS_GRAPHS", graphs)
    _, gpu = families
    classes = torch.tensor([0, 3, 5, 7])
    alone = decoding.decode(method, gpu, classes.cuda(), seed=0)
    a = decoding.decode(method, gpu, classes.cuda(), seed=0, concurrency=3, compile=True)
    b = decoding.decode(method, gpu, classes.cuda(), seed=0, concurrency=3, compile=True)
    assert torch.equal(a.tokens, b.tokens)
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < gpu.target.vocab_size
    if method == "ar":
        assert torch.equal(a.tokens, alone.tokens)
    assert a.stats.target_passes == alone.stats.target_passes or method != "ar"
    assert a.stats.images == 4 and torch.isfinite(a.images).all()
