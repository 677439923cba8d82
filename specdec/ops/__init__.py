"""specdec's public ops (docs/design.md, kernels 1-3): one module per kernel family, each with
its argument checks, its fake implementations and, where the decoders call the op every pass
(pooling, verification), the unchecked fast path they call; and one dispatch module (the
extension, the choice of backend, the registration).

    from specdec import ops
    ops.pool_probs(logits, tokens, neighbors, delta=0.1)

Every op takes `backend=None|"cuda"|"triton"|"cpu"|"reference"` (`dispatch.resolve` makes the
automatic choice, the switch SPECDEC_BACKEND overrides it). Arguments are checked here,
identically for all backends; checks over values ride in the kernels' own pass and come back as
one flag per call. The `cpu` and `cuda` backends run the compiled `torch.ops.specdec.*` ops,
which are also usable directly (and under torch.compile): they check shapes and dtypes, and the
values only when given the optional codes output (`row_errors`, `grid_errors`); a token id out
of range never makes a kernel read out of bounds.
"""
from specdec.ops import dispatch
from specdec.ops.attention import tree_attention
from specdec.ops.exact_sampling import race_noise, race_sample
from specdec.ops.pooling import PooledProbs, pool_probs, sampling_probs
from specdec.ops.verification import GridVerdict, SampleResult, sample_residual, verify_grid

__all__ = ["GridVerdict", "PooledProbs", "SampleResult", "dispatch", "pool_probs", "race_noise", "race_sample",
           "sample_residual", "sampling_probs", "tree_attention", "verify_grid"]
