"""SSD spatial draft heads (docs/decoders.md, "ssd").

Head o maps z = [h_t ; e_t] to a prediction of the target's pre-norm hidden state o raster
slots later, where h_t is the pre-norm hidden state at the slot that predicts token t (slot
P - 1 + t) and e_t the target's input embedding of the token t sampled from it. So with
offset o the prediction stands for the slot that predicts token t + o: offsets 1..5 are the
tokens to the right (horizontal heads), W and 2W the tokens below (vertical heads). The draft
distribution is the target's own final norm + LM head on the prediction (`target.head`).

    f(z) = W0 z + SwiGLU(RMSNorm(W0 z))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.gpt import RMSNorm
from specdec.numerics import RowLinear


@dataclass
class SSDHeadsConfig:
    dim: int
    grid_width: int
    n_horizontal: int = 5
    n_vertical: int = 2
    ffn_hidden: int = 256
    norm_eps: float = 1e-5

    def to_dict(self) -> dict:
        return asdict(self)


class SpatialHead(nn.Module):
    def __init__(self, dim: int, hidden: int, eps: float):
        super().__init__()
        self.w0 = RowLinear(2 * dim, dim, bias=False)
        self.norm = RMSNorm(dim, eps)
        self.w1 = RowLinear(dim, hidden, bias=False)
        self.w3 = RowLinear(dim, hidden, bias=False)
        self.w2 = RowLinear(hidden, dim, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = self.w0(z)
        n = self.norm(y)
        return y + self.w2(F.silu(self.w1(n)) * self.w3(n))


class SSDHeads(nn.Module):
    def __init__(self, config: SSDHeadsConfig):
        super().__init__()
        self.config = config
        make = lambda: SpatialHead(config.dim, config.ffn_hidden, config.norm_eps)  # noqa: E731
        self.horizontal = nn.ModuleList(make() for _ in range(config.n_horizontal))
        self.vertical = nn.ModuleList(make() for _ in range(config.n_vertical))

    @property
    def horizontal_offsets(self) -> Tuple[int, ...]:
        return tuple(range(1, self.config.n_horizontal + 1))

    @property
    def vertical_offsets(self) -> Tuple[int, ...]:
        return tuple(self.config.grid_width * (k + 1) for k in range(self.config.n_vertical))

    @property
    def offsets(self) -> Tuple[int, ...]:
        """Raster offset predicted by each head, horizontal heads first."""
        return self.horizontal_offsets + self.vertical_offsets

    @staticmethod
    def _input(hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        if hidden.shape != token_embedding.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and token_embedding {tuple(token_embedding.shape)} differ")
        return torch.cat([hidden, token_embedding], dim=-1)

    def predict_horizontal(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """[..., dim] x 2 -> [..., n_horizontal, dim] predicted hidden states at offsets 1..5."""
        z = self._input(hidden, token_embedding)
        return torch.stack([head(z) for head in self.horizontal], dim=-2)

    def predict_vertical(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """[..., dim] x 2 -> [..., n_vertical, dim] predicted hidden states one (two) rows below."""
        z = self._input(hidden, token_embedding)
        return torch.stack([head(z) for head in self.vertical], dim=-2)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """All heads: [..., n_horizontal + n_vertical, dim], in the order of `offsets`."""
        z = self._input(hidden, token_embedding)
        return torch.stack([head(z) for head in list(self.horizontal) + list(self.vertical)], dim=-2)
