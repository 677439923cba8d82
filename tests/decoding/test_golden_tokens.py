"""Every method's tokens on the embedded family are the ones recorded before the decoding package
was split by job (tests/data/record_golden_tokens.py says how and when): a move of code must not
move a token."""
import os

import pytest
import torch
from safetensors.torch import load_file

from golden_cases import CASES, decode_case
from helpers import DATA

GOLDEN = load_file(os.path.join(DATA, "golden_tokens.safetensors"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_tokens_are_the_recorded_ones(name):
    torch.set_num_threads(1)
    assert torch.equal(decode_case(name), GOLDEN[name])


def test_every_case_was_recorded():
    assert set(GOLDEN) == set(CASES)
