"""Every decoder on the embedded default family, one image at a time (the latency setting
speculative decoding is for), at the defaults of `specdec.decoding.OPTIONS`: the wall
time per image of each method, with `ar` as the baseline of the group's speed-up column.

The quality side (class accuracy, FD) needs hundreds of images and lives in `specdec compare`
(benchmarks/decoders/record_compare.py); this file is the pytest-benchmark view of the speed side.

A pytest-benchmark file: run it through run.py (run directly, its `import bench_helpers` fails):

    python benchmarks/run.py -k bench_decoders
"""
import pytest
import torch

import specdec.decoding as dec
from bench_helpers import pedantic_one_thread, synchronize
from specdec.models import default

CLASSES = torch.tensor([3, 7])      # a pullover and a sneaker: a flat and a detailed class
RUN = dec.RunSettings(seed=0)


#: every method at its defaults, and options whose cost docs/experiments.md discusses: SSD by the
#: published rule, and its exact variant (the default's commit="verify" with no bounds)
CASES = [(m, {}) for m in dec.METHODS] + [("ssd", {"commit": "write"}),
                                          ("ssd", {"max_tail": None, "final_passes": None})]


def label(method: str, options: dict, sep: str) -> str:
    return sep.join([method] + [f"{k}={v}" for k, v in options.items()])


@pytest.mark.parametrize("method,options", CASES, ids=[label(m, o, "-") for m, o in CASES])
def test_decode_two_images_default_family(benchmark, method, options):
    family = default("cpu")
    benchmark.group = "decode 2 images, one at a time, default family 16x16 cfg 2"
    benchmark.extra_info["backend"] = label(method, options, " ")
    benchmark.extra_info["baseline"] = method == "ar"

    def run():
        out = dec.decode(method, family, CLASSES, run=RUN, **options)
        synchronize("cpu")
        return out

    out = pedantic_one_thread(benchmark, run, rounds=3)
    benchmark.extra_info["target_passes_per_image"] = round(out.stats.target_forwards_per_image, 1)
    assert out.tokens.shape == (2, 16, 16)
