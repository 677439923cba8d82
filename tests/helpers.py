"""Helpers shared by the test modules (import as `from helpers import ...`)."""
import pytest
import torch

import specdec


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
