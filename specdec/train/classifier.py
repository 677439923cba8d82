"""Train the evaluator's CNN classifier on Fashion-MNIST and store reference features of
held-out test images for FD-classifier.

    python -m specdec.train classifier [--data DIR] [--steps N]
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.evaluator import FashionClassifier
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.data import load_split, to_model_images

DEFAULT_STEPS = 600
DEFAULT_BATCH = 128
# Held-out test images whose features ship with the weights: the first REFERENCE form the
# reference set, the next POOL the real images of the real-vs-real floor.
REFERENCE = 2000
POOL = 2000


def main(argv=None) -> None:
    p = common.base_parser(__doc__)
    args = p.parse_args(argv)
    common.check_args(p, args)
    common.setup(args)
    log = common.Log("classifier")
    steps, bs = args.steps or DEFAULT_STEPS, args.batch_size or DEFAULT_BATCH
    images, labels = load_split("train", args.data)
    if args.limit:
        images, labels = images[: args.limit], labels[: args.limit]
    x = to_model_images(images, 32)
    model = FashionClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3)
        idx = torch.randint(0, x.shape[0], (bs,), generator=gen)
        batch = x[idx]
        # Random 2-pixel shifts: generated images are not perfectly centred.
        dx, dy = torch.randint(-2, 3, (2,), generator=gen).tolist()
        batch = torch.roll(batch, shifts=(dy, dx), dims=(2, 3))
        loss = F.cross_entropy(model(batch), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {common.check_loss(loss, step):.4f}")
    model.eval()
    test_images, test_labels = load_split("test", args.data)
    xt = to_model_images(test_images, 32)
    with torch.no_grad():
        feats = torch.cat([model.features(b) for b in xt.split(1000)])
        acc = (model.cls(feats).argmax(-1) == test_labels).float().mean().item()
    log(f"test accuracy {acc:.4f} on {xt.shape[0]} images")
    n_ref = min(REFERENCE, feats.shape[0] // 2)  # small test splits (the smoke test) halve
    n = min(n_ref + POOL, feats.shape[0])
    # Features and labels as (non-trainable) extra tensors in the same safetensors file.
    model.register_buffer("reference_features", feats[:n_ref].half().contiguous())
    model.register_buffer("pool_features", feats[n_ref:n].half().contiguous())
    model.register_buffer("pool_labels", test_labels[n_ref:n].to(torch.int16).contiguous())
    path = os.path.join(args.out, "evaluator.safetensors")
    save_weights(model, path, {"num_classes": 10}, test_accuracy=acc, train_seconds=log.elapsed(),
                 train_cpu_seconds=log.cpu(), steps=steps)
    log(f"saved {path}")


if __name__ == "__main__":
    main()
