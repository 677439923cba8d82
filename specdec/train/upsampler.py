"""Train MuLo-SD's learned up-sampler: 8x8 low-resolution codes -> 16x16 high-resolution token logits.

    python -m specdec.train upsampler [--data DIR] [--steps N]

Pairs come from Fashion-MNIST through the shipped tokenizer: the 16x16 resize of an image gives the
low-resolution codes (what the drafter produces), the 32x32 image the high-resolution target. The
loss is in pixel space after VQ decoding, as the MuLo-SD paper found token classification alone
trains poorly: the softmax over the codebook gives an expected code vector per position, which
the frozen VQ decoder turns into an image compared with the real one (MSE); a small cross-entropy
term on the real high-resolution codes keeps the argmax on actual codes.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.decoding.upsample import WEIGHTS_NAME, TokenUpsampler
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.data import load_split, to_model_images
from specdec.train.gpt_training import load_tokenizer, tokenize


def main(argv=None) -> None:
    p = common.base_parser("train the learned up-sampler of MuLo-SD")
    p.add_argument("--ce-weight", type=float, default=0.1)
    args = p.parse_args(argv)
    common.setup(args)
    log = common.Log("upsampler")
    steps, batch = args.steps or 400, args.batch_size or 64
    tok = load_tokenizer(args.out).requires_grad_(False)
    images, _ = load_split("train", args.data)
    images = images[: args.limit or 20000]
    high_img = to_model_images(images, 32)
    low = tokenize(tok, images, 16).view(-1, 8, 8)
    high = tokenize(tok, images, 32).view(-1, 16, 16)
    log(f"{low.shape[0]} pairs of 8x8 -> 16x16 codes")
    cb = tok.codebook.detach()
    net = TokenUpsampler(tok.codebook_size, cb.shape[1], factor=2)
    net.codebook.copy_(cb)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3, warmup=30)
        idx = torch.randint(0, low.shape[0], (batch,), generator=gen)
        logits = net(low[idx])                                        # [b, V, 16, 16]
        soft = torch.einsum("bvhw,vd->bdhw", logits.softmax(1), cb)   # expected code vectors
        recon = tok.decoder(soft)
        loss_px = F.mse_loss(recon, high_img[idx])
        loss_ce = F.cross_entropy(logits, high[idx])
        loss = loss_px + args.ce_weight * loss_ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = (logits.argmax(1) == high[idx]).float().mean().item()
            log(f"step {step}/{steps} pixel mse {loss_px.item():.4f} ce {loss_ce.item():.3f} token acc {acc:.3f}")
    net.eval()
    path = os.path.join(args.out, WEIGHTS_NAME)
    save_weights(net, path, net.config, steps=steps, train_seconds=log.elapsed(), train_cpu_seconds=log.cpu())
    log(f"saved {path}")


if __name__ == "__main__":
    main()
