"""Helpers shared by the test modules (import as `from helpers import ...`: tests/ is on the path,
put there by tests/conftest.py, for the test modules in every subfolder)."""
import os

import pytest
import torch

import specdec

#: The repository's root, and the folder of the tests' recorded data.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def _devices():
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


DEVICES = _devices()


def backends_for(device: str, include_reference: bool = False):
    """Backends that can run on `device` here (the reference is the oracle, so left out)."""
    found = specdec.available_backends(torch.device(device))
    return [b for b in found if include_reference or b != "reference"]


def device_backend_pairs():
    """pytest params (device, backend) for every non-reference backend runnable here."""
    return [pytest.param(d, b, id=f"{d}-{b}") for d in DEVICES for b in backends_for(d)]


def machine_code():
    """benchmarks/machine/machine_code.py, the one reader of the kernels' machine code."""
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "machine", "machine_code.py")
    spec = importlib.util.spec_from_file_location("machine_code", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_probs_match(got, want):
    """sampling_probs' contract against the reference: the kept set (probability > 0) exactly,
    probabilities to float32 rounding, NaN rows as NaN."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN rows differ"
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok] > 0, want[ok] > 0), "kept set differs from the reference"
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, equal_nan=True)


def ar_grid(runner, conditions, streams, start_out=None) -> torch.Tensor:
    """Raster AR of a batch with the runner's AR step (`TokenStep.on_grid`, the step `ar` makes on
    the scheduler): image b draws token 0, then tokens 1 .. H*W - 1, from its own stream, as `ar`
    does. `start_out`: the prefill's outputs, when the caller has made the prefill. -> [B, H*W]."""
    from specdec.decoding.draws import draw

    out = start_out if start_out is not None else runner.prefill(conditions)
    B, HW, dev = len(streams), runner.H * runner.W, runner.device
    x = torch.zeros(B, HW, dtype=torch.long, device=dev)
    x[:, 0] = draw(runner.probs(out.select(slice(-1, None)))[:, 0], streams, runner.backend)
    u = torch.zeros(B, HW)
    u[:, 1:] = streams.rand((B * (HW - 1),)).view(B, HW - 1)
    u, position, step = u.to(dev), torch.zeros(B, 1, dtype=torch.long, device=dev), runner.token_step()
    for t in range(HW - 1):
        values, written, position = step.on_grid(x, position, u, reach=t)
        x.scatter_(1, written, values)
    return x
