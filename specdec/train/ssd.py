"""Train the SSD spatial heads on the target's own generations (self-distillation).

1. the trained target samples images with CFG (plain AR, KV cache);
2. teacher-forced passes over those tokens, with the class and with the null class, give the
   pre-norm hidden states h at every slot (the heads serve both CFG halves);
3. each head o learns [h_t ; e(x_t)] -> h_{t+o} with Smooth-L1 (see specdec/models/ssd_heads.py).

    python -m specdec.train ssd [--steps N] [--samples N]
    python -m specdec.train ssd --model JANUS_FOLDER --prompts prompts.txt --out heads/ [--device cuda]
    python -m specdec.train ssd --model GLM_IMAGE_FOLDER --height 1152 --width 768 --prompts prompts.txt --out heads/

The second form distils heads for any model specdec wraps (specdec.models.hf): its generations
come from specdec's plain AR through the adapter, its hidden states from one causal pass through
the adapter's cache (`protocol_distillation_data`).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.default import load_gpt
from specdec.models.gpt import LlamaGenGPT
from specdec.models.protocol import split_cfg
from specdec.models.sampling import sample_ar
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.models.weights_io import save_weights
from specdec.train import common
from specdec.train.gpt_training import GRID32
from specdec.train.own_generations import add_model_arguments, own_generations

DEFAULT_STEPS = 800
DEFAULT_BATCH = 512
DEFAULT_SAMPLES = 640
CFG_SCALE = 2.0
HELD_OUT = 32


@torch.no_grad()
def self_distillation_data(target: LlamaGenGPT, samples: int, gen: torch.Generator, log):
    """(hidden [2S, P + HW - 1, dim] cond rows then null-class rows, tokens [2S, HW])."""
    classes = torch.arange(samples) % target.num_classes
    grids = []
    for chunk in classes.split(128):
        grids.append(sample_ar(target, chunk, cfg_scale=CFG_SCALE, generator=gen).flatten(1))
        log(f"generated {sum(g.shape[0] for g in grids)}/{samples} images")
    tokens = torch.cat(grids)
    hidden = []
    for cls in (classes, torch.full_like(classes, target.null_class)):
        for t, c in zip(tokens.split(128), cls.split(128)):
            hidden.append(target.teacher_forward(t[:, :-1], c).hidden)
    return torch.cat(hidden), torch.cat([tokens, tokens])


def protocol_distillation_data(target, conditions, tokens: torch.Tensor, guided: bool, chunk: int = 16):
    """The same pairs for any ARImageModel (a transformers adapter, say), through its cache:
    prefill + one causal pass over each image's tokens. conditions: what the target's prefill
    takes for tokens [S, HW] (class ids or a `Prompts` batch); with `guided` the unconditional
    rows are distilled too (the heads serve both CFG halves). Returns (h_in [R, HW, dim], the
    hidden state at the slot predicting each token; tokens [R, HW]), R = S or 2S."""
    HW = tokens.shape[1]
    hidden = []
    positions = torch.arange(HW - 1)
    for i in range(0, tokens.shape[0], chunk):
        t, c = tokens[i:i + chunk], conditions[i:i + chunk]
        cache = target.new_cache(t.shape[0], cfg=guided)
        first = target.prefill(cache, c.to(cache.device) if hasattr(c, "to") else c)
        out = target.forward_tokens(cache, t[:, :-1].to(cache.device), positions.to(cache.device))
        h = torch.cat([first.hidden, out.hidden], dim=1).cpu()          # [rows, HW, dim]
        hidden.append(h)
    # Rows come chunk by chunk in the cache's order (each image's two CFG rows together); order
    # them all conditional rows first.
    if not guided:
        return torch.cat(hidden), tokens
    halves = [split_cfg(h) for h in hidden]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves]), torch.cat([tokens, tokens])


def fit_heads(target, h_in: torch.Tensor, tokens: torch.Tensor, *, steps: int, batch_size: int,
              gen: torch.Generator, log, conditional_rows: int = None, device=None) -> tuple:
    """Train SSD heads on pairs (h_in [R, HW, dim] at the slot predicting each token, tokens
    [R, HW]); the first `conditional_rows` rows are conditional (default: all), and the last
    HELD_OUT of them are held out for the argmax-agreement check. The pairs stay where they are
    (host memory for a large model); each batch moves to `device` (default: h_in's), where the
    heads train. Returns (heads, agreement per head)."""
    device = torch.device(device) if device is not None else h_in.device
    model_device = next(target.parameters()).device
    with torch.no_grad():   # e(x_t) for t in [0, HW), computed on the model's device chunk by chunk
        emb = torch.cat([target.embed_tokens(t.to(model_device)).to(h_in.device, h_in.dtype)
                         for t in tokens.split(256)])
    HW = tokens.shape[1]
    H, W = target.grid
    heads = SSDHeads(SSDHeadsConfig(dim=target.hidden_dim, grid_width=W)).to(device)
    offsets = torch.tensor(heads.offsets)
    R = tokens.shape[0]
    S = conditional_rows or R
    held_out = min(HELD_OUT, max(1, S // 4))
    all_rows = torch.arange(R)
    held = (all_rows % S) >= S - held_out
    train_rows = all_rows[~held]
    opt = torch.optim.AdamW(heads.parameters(), lr=2e-3, weight_decay=0.0)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3)
        rows = train_rows[torch.randint(0, train_rows.numel(), (batch_size,), generator=gen)]
        t = torch.randint(0, HW - 1, (batch_size,), generator=gen)
        pred = heads(h_in[rows, t].to(device), emb[rows, t].to(device))   # [bs, n_heads, dim]
        tgt_t = t[:, None] + offsets[None, :]                  # token each head stands for
        ok = (tgt_t < HW).to(device)                           # targets past the grid do not exist
        tgt = h_in[rows[:, None], tgt_t.clamp(max=HW - 1)].to(device)
        loss = (F.smooth_l1_loss(pred, tgt, reduction="none").mean(-1) * ok).sum() / ok.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} smooth-l1 {common.check_loss(loss, step):.4f}")
    # Held-out check: how often the head's draft token equals the target's argmax there.
    with torch.no_grad():
        rows = torch.arange(S - held_out, S)  # held-out conditional rows
        t = torch.arange(0, max(1, HW - 2 * W - 1))
        pred = heads(h_in[rows][:, t].to(device), emb[rows][:, t].to(device))
        to_model = lambda x: x.to(model_device, next(target.parameters()).dtype)   # noqa: E731
        agree = []
        for k, o in enumerate(heads.offsets):
            ok = t + o < HW
            draft = target.head(to_model(pred[:, ok, k])).argmax(-1)
            true = target.head(to_model(h_in[rows][:, (t + o)[ok]])).argmax(-1)
            agree.append(round(float((draft.cpu() == true.cpu()).float().mean()), 3) if ok.any() else None)
    return heads, agree


def main(argv=None) -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="target generations to distil from")
    p.add_argument("--grid", type=int, choices=(16, 32), default=16,
                   help="the embedded family: 16 (weights/), or 32 (the 32x32-token family in weights/grid32/)")
    add_model_arguments(p)
    args = p.parse_args(argv)
    common.check_args(p, args)
    if args.samples < 2:     # (a quarter of them, at least one, is held out for the agreement check)
        raise ValueError(f"--samples must be >= 2 (one is held out), got {args.samples}")
    if args.model is not None and args.grid != 16:
        raise ValueError("--grid chooses an embedded family; a --model's grid is its own (--grid-size)")
    common.setup(args)
    if args.grid == 32 and args.model is None:
        args.out = os.path.join(args.out, GRID32)
    log = common.Log("ssd" if args.grid == 16 else "ssd32")
    steps, bs = args.steps or DEFAULT_STEPS, args.batch_size or DEFAULT_BATCH
    gen = torch.Generator().manual_seed(args.seed)
    cfg_scale = CFG_SCALE if args.cfg_scale is None else args.cfg_scale
    if args.model is not None:
        target, h_in, tokens, S = _wrapped_model_data(args, cfg_scale, log)
    else:
        hint = "run `python -m specdec.train target` first" if args.grid == 16 else \
            "run `python -m specdec.train target32` first"
        target = load_gpt(os.path.join(args.out, "target.safetensors"), hint)[0]
        for prm in target.parameters():
            prm.requires_grad_(False)
        hidden, tokens = self_distillation_data(target, args.samples, gen, log)
        h_in = hidden[:, target.prefix_len - 1:]                  # h_t: the slot predicting token t
        S = tokens.shape[0] // 2
    heads, agree = fit_heads(target, h_in, tokens, steps=steps, batch_size=bs, gen=gen, log=log, conditional_rows=S,
                             device=args.device)
    log(f"held-out argmax agreement per head (offsets {heads.offsets}): {agree}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ssd_heads.safetensors")
    save_weights(heads.cpu(), path, heads.config.to_dict(), argmax_agreement=agree, samples=args.samples,
                 train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(), steps=steps,
                 **({"model": os.path.abspath(args.model)} if args.model else {}))
    log(f"saved {path}")


def _wrapped_model_data(args, cfg_scale: float, log):
    """(target, h_in, tokens, conditional rows) distilled from --model's own generations (drawn
    with the model's own sampling unless --cfg-scale is given; a model that writes a preview
    first, GLM-Image, is distilled on its target stage, each prompt followed by its preview)."""
    gen = own_generations(args, args.samples, cfg_scale, log)
    target = gen.family.target
    tokens = gen.tokens.flatten(1)
    with torch.no_grad():
        h_in, rows = protocol_distillation_data(target, gen.conditions, tokens, gen.sampling.guided)
    return target, h_in.float(), rows, tokens.shape[0]


if __name__ == "__main__":
    main()
