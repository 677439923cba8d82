"""Train the shared VQ tokenizer on Fashion-MNIST at both resolutions (32x32 and 16x16).

    python -m specdec.train vq [--data DIR] [--steps N]
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.vq import VQConfig, VQTokenizer
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.data import load_split, to_model_images

DEFAULT_STEPS = 300
DEFAULT_BATCH = 128


def _restart_dead_codes(model: VQTokenizer, usage: torch.Tensor, latents: torch.Tensor, gen) -> int:
    """Move codes no latent chose lately onto random recent latents (keeps the codebook alive)."""
    dead = (usage == 0).nonzero().flatten()
    if dead.numel():
        flat = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
        pick = torch.randint(0, flat.shape[0], (dead.numel(),), generator=gen)
        with torch.no_grad():
            model.embedding.weight[dead] = flat[pick]
    return int(dead.numel())


def main(argv=None) -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--codebook-size", type=int, default=256)
    args = p.parse_args(argv)
    common.check_args(p, args)
    if args.codebook_size < 2:
        raise ValueError(f"--codebook-size must be an int >= 2, got {args.codebook_size}")
    common.setup(args)
    log = common.Log("vq")
    steps = args.steps or DEFAULT_STEPS
    bs = args.batch_size or DEFAULT_BATCH
    images, _ = load_split("train", args.data)
    if args.limit:
        images = images[: args.limit]
    hi = to_model_images(images, 32)
    lo = to_model_images(images, 16)
    model = VQTokenizer(VQConfig(codebook_size=args.codebook_size))
    gen = torch.Generator().manual_seed(args.seed)
    # Start the codebook on real latents rather than random directions.
    with torch.no_grad():
        z = model._latents(hi[torch.randint(0, hi.shape[0], (64,), generator=gen)])
        _restart_dead_codes(model, torch.zeros(model.codebook_size), z, gen)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    usage = torch.zeros(model.codebook_size)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3)
        idx = torch.randint(0, hi.shape[0], (bs,), generator=gen)
        loss_total = 0.0
        for batch in (hi[idx], lo[idx[: bs // 2]]):
            recon, vq_loss, codes = model(batch)
            loss = F.mse_loss(recon, batch) + vq_loss
            loss.backward()
            loss_total += loss.item()
            usage += torch.bincount(codes.flatten(), minlength=model.codebook_size).float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 49 and step < steps - 100:
            with torch.no_grad():
                dead = _restart_dead_codes(model, usage, model._latents(hi[idx]), gen)
            usage.zero_()
        else:
            dead = None
        if step % 50 == 0 or step == steps - 1:
            common.check_loss(torch.tensor(loss_total), step)
            log(f"step {step}/{steps} loss {loss_total:.4f}" + (f" restarted {dead}" if dead else ""))
    model.eval()
    test, _ = load_split("test", args.data)
    with torch.no_grad():
        for size in (64, 32, 16):   # 64: the 32x32-token family's images
            x = to_model_images(test[:2000], size)
            codes = model.encode(x)
            mse = F.mse_loss(model.decode(codes), x).item()
            used = torch.unique(codes).numel()
            log(f"test {size}x{size}: reconstruction mse {mse:.4f}, codes used {used}/{model.codebook_size}")
    path = os.path.join(args.out, "tokenizer.safetensors")
    save_weights(model, path, model.config.to_dict(), train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(),
                 steps=steps)
    log(f"saved {path}")


if __name__ == "__main__":
    main()
