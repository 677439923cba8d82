"""Train MuLo-SD's learned up-sampler: 8x8 low-resolution codes -> 16x16 high-resolution token logits.

    python -m specdec.train upsampler [--data DIR] [--steps N]
    python -m specdec.train upsampler --model JANUS_FOLDER --prompts prompts.txt --out heads/ [--device cuda]
    python -m specdec.train upsampler --model GLM_IMAGE_FOLDER --height 1024 --width 1024 --prompts p.txt --out up/

Pairs come from Fashion-MNIST through the shipped tokenizer: the 16x16 resize of an image gives the
low-resolution codes (what the drafter produces), the 32x32 image the high-resolution target. The
loss is in pixel space after VQ decoding, as the MuLo-SD paper found token classification alone
trains poorly: the softmax over the codebook gives an expected code vector per position, which
the frozen VQ decoder turns into an image compared with the real one (MSE); a small cross-entropy
term on the real high-resolution codes keeps the argmax on actual codes.

With --model (any model specdec wraps, specdec.models.hf), the pairs are the model's own
generations and their down-sampled views; the pixel loss needs the family's tokenizer to offer
`decode_code_vectors` (code vectors -> images), else the loss is the cross-entropy alone. A model
that writes its own preview first (GLM-Image) gives the pairs itself: each generation's preview
and target grids (the size of --height and --width must make the target an integer multiple r of
the preview, the same per side: 1024 x 1024 gives 16x16 -> 32x32; no pixel decoder, so the
cross-entropy alone).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.upsampler import WEIGHTS_NAME, TokenUpsampler
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.data import load_split, to_model_images
from specdec.train.gpt_training import GRID32, load_tokenizer, tokenize
from specdec.train.own_generations import add_model_arguments, own_generations


def fit_upsampler(codebook: torch.Tensor, low: torch.Tensor, high: torch.Tensor, *, factor: int, steps: int,
                  batch_size: int, gen: torch.Generator, log, decode_vectors=None, high_images=None,
                  ce_weight: float = 0.1) -> TokenUpsampler:
    """Train a TokenUpsampler on pairs low [N, h, w] -> high [N, factor h, factor w] codes of one
    codebook [V, D]. With `decode_vectors` (code vectors [B, D, H, W] -> images, differentiable)
    and the real `high_images`, the loss is MSE in pixel space on the expected code vectors plus
    `ce_weight` x cross-entropy on the real codes; without them, cross-entropy alone."""
    cb = codebook.detach().float()
    net = TokenUpsampler(cb.shape[0], cb.shape[1], factor=factor).to(cb.device)
    net.codebook.copy_(cb)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    pixel = decode_vectors is not None and high_images is not None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3, warmup=30)
        idx = torch.randint(0, low.shape[0], (batch_size,), generator=gen)
        logits = net(low[idx])                                        # [b, V, H, W]
        loss_ce = F.cross_entropy(logits, high[idx])
        if pixel:
            soft = torch.einsum("bvhw,vd->bdhw", logits.softmax(1), cb)   # expected code vectors
            loss_px = F.mse_loss(decode_vectors(soft), high_images[idx])
            loss = loss_px + ce_weight * loss_ce
        else:
            loss_px, loss = torch.zeros(()), loss_ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            common.check_loss(loss, step)
            with torch.no_grad():
                acc = (logits.argmax(1) == high[idx]).float().mean().item()
            px = f"pixel mse {loss_px.item():.4f} " if pixel else "(no pixel loss) "
            log(f"step {step}/{steps} {px}ce {loss_ce.item():.3f} token acc {acc:.3f}")
    return net.eval()


def main(argv=None) -> None:
    p = common.base_parser("train the learned up-sampler of MuLo-SD")
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=256, help="with --model: generations to train on")
    p.add_argument("--factor", type=int, default=2, help="with --model: resolution ratio r of target and drafter")
    p.add_argument("--grid", type=int, choices=(16, 32), default=16,
                   help="the embedded family's target grid: 16 (8x8 -> 16x16, weights/) or 32 (16x16 -> 32x32, "
                        "the 32x32-token family in weights/grid32/)")
    add_model_arguments(p)
    args = p.parse_args(argv)
    common.check_args(p, args, model_only=("samples", "factor"))
    if args.factor < 1:
        raise ValueError(f"--factor must be an int >= 1, got {args.factor}")
    if args.model is not None and args.grid != 16:
        raise ValueError("--grid chooses an embedded family; a --model's grid is its own (--grid-size)")
    common.setup(args)
    log = common.Log("upsampler" if args.grid == 16 else "upsampler32")
    steps, batch = args.steps or 400, args.batch_size or 64
    gen = torch.Generator().manual_seed(args.seed)
    if args.model is not None:
        net = _fit_on_wrapped_model(args, steps, batch, gen, log)
    else:
        tok = load_tokenizer(args.out).requires_grad_(False)
        if args.grid == 32:
            args.out = os.path.join(args.out, GRID32)
        images, _ = load_split("train", args.data)
        images = images[: args.limit or 20000]
        size, h = 2 * args.grid, args.grid // 2          # the target's image size, the drafter's grid side
        high_img = to_model_images(images, size)
        low = tokenize(tok, images, size // 2).view(-1, h, h)
        high = tokenize(tok, images, size).view(-1, 2 * h, 2 * h)
        log(f"{low.shape[0]} pairs of {h}x{h} -> {2 * h}x{2 * h} codes")
        net = fit_upsampler(tok.codebook, low, high, factor=2, steps=steps, batch_size=batch, gen=gen, log=log,
                            decode_vectors=tok.decoder, high_images=high_img, ce_weight=args.ce_weight)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, WEIGHTS_NAME)
    save_weights(net.cpu(), path, net.config, steps=steps, train_seconds=log.elapsed(), train_cpu_seconds=log.cpu())
    log(f"saved {path}")


def _fit_on_wrapped_model(args, steps: int, batch: int, rng: torch.Generator, log) -> TokenUpsampler:
    """Pairs from a wrapped model's own generations: the target's grids are the high-resolution
    codes, their down-sampled views (VQ decode, area-resize by 1/r, VQ encode) the low ones."""
    gen = own_generations(args, args.samples, 2.0 if args.cfg_scale is None else args.cfg_scale, log)
    family, high = gen.family, gen.tokens
    if gen.preview is not None:
        return _fit_on_previews(args, gen, steps, batch, rng, log)
    tok = family.tokenizer
    if tok is None or not hasattr(tok, "encode"):
        raise SystemExit(f"--model {args.model}: no VQ encoder (LlamaGen: pass --vq), which the up-sampler's pairs "
                         "need")
    if high.shape[1] % args.factor or high.shape[2] % args.factor:
        raise SystemExit(f"--factor {args.factor} does not divide the model's grid {tuple(high.shape[1:])}")
    high = high.to(args.device)
    with torch.no_grad():
        low = downsample(high, args.factor, tokenizer=tok)
        images = tok.decode(high)
    log(f"{low.shape[0]} pairs of {tuple(low.shape[1:])} -> {tuple(high.shape[1:])} codes")
    return fit_upsampler(family.codebook, low, high, factor=args.factor, steps=steps, batch_size=batch, gen=rng,
                         log=log, decode_vectors=getattr(tok, "decode_code_vectors", None), high_images=images,
                         ce_weight=args.ce_weight)


def _fit_on_previews(args, gen, steps: int, batch: int, rng: torch.Generator, log) -> TokenUpsampler:
    """Pairs of a model that writes its own preview (GLM-Image): each generation's preview grid
    (low) and target grid (high), at the integer ratio the sizes give."""
    (h, w), (H, W) = tuple(gen.preview.shape[1:]), tuple(gen.tokens.shape[1:])
    if H % h or W % w or H // h != W // w:
        raise SystemExit(f"the preview {h}x{w} does not divide the target {H}x{W} by one factor per side: the learned "
                         "up-sampler needs one (GLM-Image: --height 1024 --width 1024 gives 16x16 -> 32x32); MuLo-SD "
                         "up-samples other previews with upsample='nearest'")
    log(f"{gen.preview.shape[0]} pairs of preview {h}x{w} -> target {H}x{W} codes (factor {H // h})")
    return fit_upsampler(gen.family.codebook.to(args.device), gen.preview.to(args.device), gen.tokens.to(args.device),
                         factor=H // h, steps=steps, batch_size=batch, gen=rng, log=log, ce_weight=args.ce_weight)


@torch.no_grad()
def downsample(high: torch.Tensor, factor: int, *, tokenizer) -> torch.Tensor:
    """[B, H, W] codes -> [B, H / factor, W / factor] codes through pixel space (VQ decode,
    area-resize by 1/factor, VQ encode): the low-resolution view of a high-resolution grid."""
    img = tokenizer.decode(high)
    img = F.interpolate(img, scale_factor=1.0 / factor, mode="area")
    return tokenizer.encode(img).long()


if __name__ == "__main__":
    main()
