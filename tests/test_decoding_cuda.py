"""Every decoder on CUDA tensors, on the embedded default family: what users run on a GPU box.

The CPU suite runs the decoders on tiny random models; here the trained family moves to the GPU,
where the kernels are compiled Triton and CUDA C++ rather than the CPU backends. Sampling on CUDA
draws from a CUDA generator, so tokens cannot be compared with the CPU's; what must hold is that
the target's logits agree with the CPU's, that every method is deterministic under a seed and
gives valid grids, and that SSD's commit="verify" pass count follows its CPU schedule.
"""
import pytest
import torch

from specdec import decoding
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
    from specdec import cli

    _, gpu = families
    rows, _, _ = cli.run_compare(gpu, ["ar", "mulo"], 4, 0, decoding.Sampling(cfg_scale=2.0), {},
                                 out_dir=str(tmp_path), warmup=False, show_progress=False)
    assert [r["method"] for r in rows] == ["ar", "mulo"]
    for r in rows:
        assert 0.0 <= r["class_accuracy"] <= 1.0 and r["fd"] >= 0.0
    assert (tmp_path / "mulo_maps.png").exists()
