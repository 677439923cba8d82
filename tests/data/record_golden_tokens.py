"""Record the token grids that tests/decoding/test_golden_tokens.py holds every method to.

The grids were recorded from commit 020ccd4 (2026-12-02), before the decoding package was split
by job and the per-method options became dataclasses: the move must not change a token. Run it
again only when a change of tokens is intended, and say why in the commit:

    python tests/data/record_golden_tokens.py
"""
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from golden_cases import CASES, decode_case  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    grids = {}
    for name in CASES:
        grids[name] = decode_case(name).contiguous()
        print(name, tuple(grids[name].shape), flush=True)
    path = os.path.join(os.path.dirname(__file__), "golden_tokens.safetensors")
    save_file(grids, path)
    print("wrote", path)
