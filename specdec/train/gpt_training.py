"""The GPTs of the default family and their one training loop: next-token cross entropy on VQ
codes of Fashion-MNIST, class-conditional with label dropout (the null class) for CFG.

    python -m specdec.train target       # 16x16 tokens (32x32 images): the model being accelerated
    python -m specdec.train drafter      # 8x8 tokens (16x16 images): MuLo-SD's low-resolution drafter (r = 2)
    python -m specdec.train sd_drafter   # a smaller GPT on the target's 16x16 grid: the drafter of sd /
                                         # lantern (MuLo-SD's cannot serve, being on the 8x8 grid)
    python -m specdec.train target32     # the 32x32-token family (64x64 images, weights/grid32/): its
    python -m specdec.train sd_drafter32 # target and same-grid drafter; the 16x16 target drafts for
                                         # MuLo-SD (r = 2, MuLo-SD's LlamaGen 512 / 256 px setting)
"""
from __future__ import annotations

import os

import torch

from specdec.models.default import load_vq
from specdec.models.gpt import GPTConfig, LlamaGenGPT
from specdec.models.vq import VQTokenizer
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.data import NUM_CLASSES, load_split, to_model_images


#: The 32x32-token family's folder, under the embedded family's (it shares the tokenizer).
GRID32 = "grid32"

#: name -> the model's shape and its training schedule.
RECIPES = {
    "target": dict(image_size=32, config=dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=16),
                   steps=600, batch=32, lr=2e-3),
    "drafter": dict(image_size=16, config=dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=8),
                    steps=500, batch=64, lr=2e-3),
    "sd_drafter": dict(image_size=32, config=dict(dim=64, n_layer=2, n_head=4, multiple_of=32, grid_size=16),
                       steps=600, batch=32, lr=3e-3),
    # The 32x32-token family: the same VQ on the images up-sampled 2x (64x64 px), written to
    # weights/grid32/ as target.safetensors and sd_drafter.safetensors.
    "target32": dict(image_size=64, config=dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=32),
                     steps=2400, batch=16, lr=2e-3, file="target", folder=GRID32),
    "sd_drafter32": dict(image_size=64, config=dict(dim=64, n_layer=2, n_head=4, multiple_of=32, grid_size=32),
                         steps=600, batch=16, lr=3e-3, file="sd_drafter", folder=GRID32),
}


def train_recipe(name: str, argv=None) -> None:
    recipe = dict(RECIPES[name])
    train_gpt(name, argv, config=GPTConfig(**recipe.pop("config")), **recipe)


def load_tokenizer(folder: str) -> VQTokenizer:
    """The family's VQ: in `folder`, or for the 32x32-token family (grid32/) in the folder above."""
    path = os.path.join(folder, "tokenizer.safetensors")
    if not os.path.exists(path) and os.path.basename(os.path.normpath(folder)) == GRID32:
        path = os.path.join(os.path.dirname(os.path.normpath(folder)), "tokenizer.safetensors")
    return load_vq(path, "run `python -m specdec.train vq` first")[0]


@torch.no_grad()
def tokenize(tokenizer: VQTokenizer, images_u8: torch.Tensor, size: int) -> torch.Tensor:
    x = to_model_images(images_u8, size)
    return torch.cat([tokenizer.encode(b).flatten(1) for b in x.split(2000)])


def train_gpt(name: str, argv, *, image_size: int, config: GPTConfig, steps: int, batch: int, lr: float,
              file: str = None, folder: str = None) -> None:
    """`folder`: a subfolder of --out the weights go to (the 32x32-token family's), as `file`."""
    p = common.base_parser(f"train the {name} GPT")
    args = p.parse_args(argv)
    common.check_args(p, args)
    common.setup(args)
    if folder is not None:
        args.out = os.path.join(args.out, folder)
        os.makedirs(args.out, exist_ok=True)
    log = common.Log(name)
    steps, batch = args.steps or steps, args.batch_size or batch
    tokenizer = load_tokenizer(args.out)
    images, labels = load_split("train", args.data)
    if args.limit:
        images, labels = images[: args.limit], labels[: args.limit]
    codes = tokenize(tokenizer, images, image_size)
    log(f"tokenized {codes.shape[0]} images to {codes.shape[1]} tokens each")
    config.vocab_size = tokenizer.codebook_size
    config.num_classes = NUM_CLASSES
    model = LlamaGenGPT(config)
    log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embedding" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, lr, warmup=100)
        idx = torch.randint(0, codes.shape[0], (batch,), generator=gen)
        cls = labels[idx].clone()
        drop = torch.rand(batch, generator=gen) < config.class_dropout_prob
        cls[drop] = model.null_class
        loss = model.training_loss(codes[idx], cls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {common.check_loss(loss, step):.4f}")
    model.eval()
    path = os.path.join(args.out, f"{file or name}.safetensors")
    save_weights(model, path, config.to_dict(), train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(), steps=steps)
    test, test_labels = load_split("test", args.data)
    with torch.no_grad():
        # Saved first, evaluated in chunks: 2000 sequences of 1024 tokens at once (the 32x32
        # family) need more memory than the development machine has.
        tcodes = tokenize(tokenizer, test[:2000], image_size)
        losses = [float(model.training_loss(c, y)) * c.shape[0]
                  for c, y in zip(tcodes.split(100), test_labels[:2000].split(100))]
        test_loss = sum(losses) / tcodes.shape[0]
    log(f"test loss {test_loss:.4f} (nats per token)")
    save_weights(model, path, config.to_dict(), test_loss=test_loss, train_seconds=log.elapsed(),
                 train_cpu_seconds=log.cpu(), steps=steps)
    log(f"saved {path}")
