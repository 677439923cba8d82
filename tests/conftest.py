"""Test configuration shared by the whole suite.

Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter, which must be
switched on before triton is first imported; with a GPU they are compiled for real and every
test also runs on CUDA tensors.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import specdec  # noqa: E402, F401  (imported once here, after the switch above, for every test)

settings.register_profile(
    "specdec",
    deadline=None,  # the Triton interpreter's first call of a kernel is slow
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("specdec")


from helpers import DEVICES  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
