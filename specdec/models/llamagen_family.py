"""A LlamaGen checkpoint (and its VQ) as a model family for `specdec.decoding.decode`.

    fam = load_llamagen_family("t2i_XL_stage1_256.pt", "vq_ds16_t2i.pt", gpt_size="GPT-XL")
    out = specdec.decoding.decode("ar", fam, prompts=read_caption_embeddings("captions.pt"))

The family holds the target, the VQ as tokenizer (codes -> pixels) and its codebook (for the
neighbour tables of LANTERN and MuLo-SD). It has no drafter, SSD heads or up-sampler: pass them
to `decode` as keyword arguments (drafter=, heads=, upsampler=) where a method takes them;
MuLo-SD without an up-sampler up-samples in pixel space through the VQ.
"""
from __future__ import annotations

from typing import Optional

from specdec.models.family import ModelFamily
from specdec.models.loaders import load_llamagen, load_llamagen_vq


def load_llamagen_family(gpt_path: str, vq_path: Optional[str] = None, *, gpt_size="GPT-XL", grid_size: int = 16,
                         vq_size="VQ-16", device=None, dtype=None, trust_pickle: bool = False) -> ModelFamily:
    """The GPT checkpoint (class-conditional or text-to-image, see load_llamagen) and, when given,
    its VQ checkpoint; the VQ's codebook size must be the GPT's vocabulary."""
    target = load_llamagen(gpt_path, gpt_size, grid_size=grid_size, device=device, dtype=dtype,
                           trust_pickle=trust_pickle)
    vq = None
    if vq_path is not None:
        vq = load_llamagen_vq(vq_path, vq_size, device=device, trust_pickle=trust_pickle)
        if vq.codebook_size != target.vocab_size:
            raise ValueError(f"{vq_path}: the VQ has {vq.codebook_size} codes, the GPT {gpt_path} a vocabulary of "
                             f"{target.vocab_size}: not a matching pair")
    return ModelFamily(target, tokenizer=vq, codebook=None if vq is None else vq.codebook)
