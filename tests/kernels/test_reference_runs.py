"""The reference labels the islands of one-row grids (the decoders' drafts) in closed form, with
no host read; on every such grid the labels are those of the 2-D labelling rounds."""
import torch

from specdec.profiling import count_host_syncs
from specdec.reference import verification as ref


def test_runs_are_the_islands_of_one_row_grids():
    g = torch.Generator().manual_seed(0)
    for w in (1, 2, 5, 17, 64):
        for b in (1, 3):
            for _ in range(40):
                mask = torch.rand(b, 1, w, generator=g) < torch.rand(1, generator=g)
                assert torch.equal(ref.label_runs(mask), ref.label_islands(mask))


def test_a_one_row_verdict_reads_nothing_back():
    p, q, u = torch.rand(2, 1, 24), torch.rand(2, 1, 24), torch.rand(2, 1, 24)
    with count_host_syncs() as c:
        ref.verify_grid(p, q, rule="ratio", uniforms=u, mode="raster")
        ref.verify_grid(p, q, rule="ratio", uniforms=u, mode="independent")
    assert c.round_trips == 0, c.by_op
