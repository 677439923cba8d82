"""Outputs of kernels that have no backward, as autograd nodes whose backward raises.

The cpu, triton and cuda kernels compute forward values only. Without a node of their own in the
graph, autograd would drop the gradients of their inputs with a warning at most (cpu) or silently
(triton): a fine-tune through them would freeze what feeds them. The reference backend is plain
PyTorch and differentiates, so its outputs are left as they are."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: str, backend: str, hint: str, n_outputs: int, *tensors):
        ctx.op, ctx.backend, ctx.hint = op, backend, hint
        return tuple(t.view_as(t) for t in tensors[:n_outputs])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op} has no backward on the {ctx.backend} backend: run inference under "
                           f"torch.no_grad(); to train through it, use backend='reference' (pure PyTorch){ctx.hint}")


def guard(op: str, backend: str, outputs: Tuple[torch.Tensor, ...], inputs: Sequence[Optional[torch.Tensor]],
          hint: str = "") -> Tuple[torch.Tensor, ...]:
    """`outputs` of `op` on `backend`, made nodes whose backward raises when autograd would
    otherwise track `inputs` through them (grad enabled, an input that requires grad)."""
    if backend == "reference" or not torch.is_grad_enabled():
        return outputs
    tracked = [t for t in inputs if t is not None and t.requires_grad]
    if not tracked:
        return outputs
    return _NoBackward.apply(op, backend, hint, len(outputs), *outputs, *tracked)


__all__ = ["guard"]
