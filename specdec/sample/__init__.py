"""Generation at scale: `specdec sample` (see specdec/sample/runner.py for the directory layout and
docs/sampling.md for the commands). One module per job: plan (items and work split), settings
(what must match to resume), store (atomic files, manifest, npz), world (torch.distributed),
runner (the whole run); rank 0 shows specdec.progress.ProgressLine."""
from specdec.sample.plan import Refused, SampleError
from specdec.sample.runner import Request, run
from specdec.sample.world import World, join

__all__ = ["Request", "Refused", "SampleError", "World", "join", "run"]
