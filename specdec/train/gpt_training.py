"""The GPTs of the default family and their one training loop: next-token cross entropy on VQ
codes of Fashion-MNIST, class-conditional with label dropout (the null class) for CFG.

    python -m specdec.train target       # 16x16 tokens (32x32 images): the model being accelerated
    python -m specdec.train drafter      # 8x8 tokens (16x16 images): MuLo-SD's low-resolution drafter (r = 2)
    python -m specdec.train sd_drafter   # a smaller GPT on the target's 16x16 grid: the drafter of sd /
                                         # lantern (MuLo-SD's cannot serve, being on the 8x8 grid)
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


#: name -> the model's shape and its training schedule.
RECIPES = {
    "target": dict(image_size=32, config=dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=16),
                   steps=600, batch=32, lr=2e-3),
    "drafter": dict(image_size=16, config=dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=8),
                    steps=500, batch=64, lr=2e-3),
    "sd_drafter": dict(image_size=32, config=dict(dim=64, n_layer=2, n_head=4, multiple_of=32, grid_size=16),
                       steps=600, batch=32, lr=3e-3),
}


def train_recipe(name: str, argv=None) -> None:
    recipe = dict(RECIPES[name])
    train_gpt(name, argv, config=GPTConfig(**recipe.pop("config")), **recipe)


def load_tokenizer(folder: str) -> VQTokenizer:
    return load_vq(os.path.join(folder, "tokenizer.safetensors"), "run `python -m specdec.train vq` first")[0]


@torch.no_grad()
def tokenize(tokenizer: VQTokenizer, images_u8: torch.Tensor, size: int) -> torch.Tensor:
    x = to_model_images(images_u8, size)
    return torch.cat([tokenizer.encode(b).flatten(1) for b in x.split(2000)])


def train_gpt(name: str, argv, *, image_size: int, config: GPTConfig, steps: int, batch: int, lr: float) -> None:
    p = common.base_parser(f"train the {name} GPT")
    args = p.parse_args(argv)
    common.setup(args)
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
            log(f"step {step}/{steps} loss {loss.item():.4f}")
    model.eval()
    test, test_labels = load_split("test", args.data)
    with torch.no_grad():
        tcodes = tokenize(tokenizer, test[:2000], image_size)
        test_loss = float(model.training_loss(tcodes, test_labels[:2000]))
    log(f"test loss {test_loss:.4f} (nats per token)")
    path = os.path.join(args.out, f"{name}.safetensors")
    save_weights(model, path, config.to_dict(), test_loss=test_loss, train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(), steps=steps)
    log(f"saved {path}")
