"""Train the SSD spatial heads on the target's own generations (self-distillation).

1. the trained target samples images with CFG (plain AR, KV cache);
2. teacher-forced passes over those tokens, with the class and with the null class, give the
   pre-norm hidden states h at every slot (the heads serve both CFG halves);
3. each head o learns [h_t ; e(x_t)] -> h_{t+o} with Smooth-L1 (see specdec/models/ssd_heads.py).

    python -m specdec.train ssd [--steps N] [--samples N]
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.default import load_gpt
from specdec.models.gpt import LlamaGenGPT
from specdec.models.sampling import sample_ar
from specdec.models.ssd_heads import SSDHeads, SSDHeadsConfig
from specdec.models.weights_io import save_weights
from specdec.train import common

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


def main(argv=None) -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="target generations to distil from")
    args = p.parse_args(argv)
    common.setup(args)
    log = common.Log("ssd")
    steps, bs = args.steps or DEFAULT_STEPS, args.batch_size or DEFAULT_BATCH
    target = load_gpt(os.path.join(args.out, "target.safetensors"), "run `python -m specdec.train target` first")[0]
    for prm in target.parameters():
        prm.requires_grad_(False)
    gen = torch.Generator().manual_seed(args.seed)
    hidden, tokens = self_distillation_data(target, args.samples, gen, log)
    with torch.no_grad():
        emb = target.embed_tokens(tokens)                      # e(x_t) for t in [0, HW)
    P, HW = target.prefix_len, tokens.shape[1]
    h_in = hidden[:, P - 1:]                                   # h_t: the slot predicting token t
    H, W = target.grid
    heads = SSDHeads(SSDHeadsConfig(dim=target.hidden_dim, grid_width=W))
    offsets = torch.tensor(heads.offsets)
    # The last HELD_OUT generations (both CFG halves) are kept out of training for the check below.
    S = tokens.shape[0] // 2
    held_out = min(HELD_OUT, max(1, S // 4))
    all_rows = torch.arange(2 * S)
    held = (all_rows % S) >= S - held_out
    train_rows = all_rows[~held]
    opt = torch.optim.AdamW(heads.parameters(), lr=2e-3, weight_decay=0.0)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = common.cosine_lr(step, steps, 2e-3)
        rows = train_rows[torch.randint(0, train_rows.numel(), (bs,), generator=gen)]
        t = torch.randint(0, HW - 1, (bs,), generator=gen)
        pred = heads(h_in[rows, t], emb[rows, t])              # [bs, n_heads, dim]
        tgt_t = t[:, None] + offsets[None, :]                  # token each head stands for
        ok = tgt_t < HW                                        # targets past the grid do not exist
        tgt = h_in[rows[:, None], tgt_t.clamp(max=HW - 1)]
        loss = (F.smooth_l1_loss(pred, tgt, reduction="none").mean(-1) * ok).sum() / ok.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} smooth-l1 {loss.item():.4f}")
    # Held-out check: how often the head's draft token equals the target's argmax there.
    with torch.no_grad():
        rows = torch.arange(S - held_out, S)  # held-out conditional rows
        t = torch.arange(0, HW - 2 * W - 1)
        pred = heads(h_in[rows][:, t], emb[rows][:, t])
        agree = []
        for k, o in enumerate(heads.offsets):
            draft = target.head(pred[:, :, k]).argmax(-1)
            true = target.head(h_in[rows][:, t + o]).argmax(-1)
            agree.append(round(float((draft == true).float().mean()), 3))
    log(f"held-out argmax agreement per head (offsets {heads.offsets}): {agree}")
    path = os.path.join(args.out, "ssd_heads.safetensors")
    save_weights(heads, path, heads.config.to_dict(), argmax_agreement=agree, samples=args.samples,
                 train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(), steps=steps)
    log(f"saved {path}")


if __name__ == "__main__":
    main()
