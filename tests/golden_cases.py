"""The decodes whose token grids are recorded in tests/data/golden_tokens.safetensors: every
method on the embedded family with its defaults, and the papers' readings that stay as options."""
import torch

CLASSES = [1, 7]
SEED = 3

#: name -> (method, options)
CASES = {
    "ar": ("ar", {}),
    "sd": ("sd", {}),
    "lantern": ("lantern", {}),
    "sjd": ("sjd", {}),
    "zipar": ("zipar", {}),
    "mulo": ("mulo", {}),
    "mulo_zipar_drafting": ("mulo", {"drafting": "zipar"}),
    "mulo_raster_resample": ("mulo", {"resample": "raster"}),
    "mulo_nearest": ("mulo", {"upsample": "nearest"}),
    "mulo_pixel": ("mulo", {"upsample": "pixel"}),
    "ssd": ("ssd", {}),
    "ssd_write": ("ssd", {"commit": "write", "max_tail": None, "final_passes": None}),
    "ssd_two_vertical_heads": ("ssd", {"vertical_heads": 2}),
    "ssd_batch2": ("ssd", {"batch_size": 2}),
    "mulo_batch2": ("mulo", {"batch_size": 2}),
}


def decode_case(name: str) -> torch.Tensor:
    from specdec import decoding
    from specdec.models import default

    method, options = CASES[name]
    return decoding.decode(method, default(), CLASSES, seed=SEED, **options).tokens
