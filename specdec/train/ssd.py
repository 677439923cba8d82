"""Train the SSD spatial heads on the target's own generations (self-distillation).

1. the trained target samples images with CFG (plain AR, KV cache);
2. teacher-forced passes over those tokens, with the class and with the null class, give the
   pre-norm hidden states h at every slot (the heads serve both CFG halves);
3. each head o learns [h_t ; e(x_t)] -> h_{t+o} with Smooth-L1 (see specdec/models/ssd_heads.py).

    python -m specdec.train ssd [--steps N] [--samples N]
    python -m specdec.train ssd --model JANUS_FOLDER --prompts prompts.txt --out heads/ [--device cuda]

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


def protocol_distillation_data(target, conditions, tokens: torch.Tensor, guided: bool, chunk: int = 16):
    """The same pairs for any ARImageModel (a transformers adapter, say), through its cache:
    prefill + one causal pass over each image's tokens. conditions: what the target's prefill
    takes for tokens [S, HW] (class ids or a `Prompts` batch); with `guided` the unconditional
    rows are distilled too (the heads serve both CFG halves). Returns (h_in [R, HW, dim], the
    hidden state at the slot predicting each token; tokens [R, HW]), R = S or 2S."""
    HW = tokens.shape[1]
    hidden, rows = [], []
    positions = torch.arange(HW - 1)
    for i in range(0, tokens.shape[0], chunk):
        t, c = tokens[i:i + chunk], conditions[i:i + chunk]
        cache = target.new_cache(t.shape[0], cfg=guided)
        first = target.prefill(cache, c.to(cache.device) if hasattr(c, "to") else c)
        out = target.forward_tokens(cache, t[:, :-1].to(cache.device), positions.to(cache.device))
        h = torch.cat([first.hidden, out.hidden], dim=1).cpu()          # [rows, HW, dim]
        hidden.append(h)
        rows.append(torch.cat([t, t]) if guided else t)
    # Rows come chunk by chunk as [cond; uncond]; order them all conditional rows first.
    cond = torch.cat([h[: h.shape[0] // (2 if guided else 1)] for h in hidden])
    parts = [cond]
    if guided:
        parts.append(torch.cat([h[h.shape[0] // 2:] for h in hidden]))
    return torch.cat(parts), torch.cat([tokens, tokens]) if guided else tokens


def fit_heads(target, h_in: torch.Tensor, tokens: torch.Tensor, *, steps: int, batch_size: int,
              gen: torch.Generator, log, conditional_rows: int = None) -> tuple:
    """Train SSD heads on pairs (h_in [R, HW, dim] at the slot predicting each token, tokens
    [R, HW]); the first `conditional_rows` rows are conditional (default: all), and the last
    HELD_OUT of them are held out for the argmax-agreement check. Returns (heads, agreement per head)."""
    with torch.no_grad():
        emb = target.embed_tokens(tokens.to(h_in.device)).to(h_in.dtype)   # e(x_t) for t in [0, HW)
    HW = tokens.shape[1]
    H, W = target.grid
    heads = SSDHeads(SSDHeadsConfig(dim=target.hidden_dim, grid_width=W)).to(h_in.device)
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
        t = torch.arange(0, max(1, HW - 2 * W - 1))
        pred = heads(h_in[rows][:, t], emb[rows][:, t])
        agree = []
        for k, o in enumerate(heads.offsets):
            ok = t + o < HW
            draft = target.head(pred[:, ok, k]).argmax(-1)
            true = target.head(h_in[rows][:, (t + o)[ok]]).argmax(-1)
            agree.append(round(float((draft == true).float().mean()), 3) if ok.any() else None)
    return heads, agree


def main(argv=None) -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="target generations to distil from")
    p.add_argument("--model", default=None,
                   help="a transformers save_pretrained folder (Janus, Emu3, Chameleon) instead of the embedded target")
    p.add_argument("--prompts", default=None,
                   help="with --model: a text file, one prompt per line, cycled over the samples")
    p.add_argument("--cfg-scale", type=float, default=None, help=f"guidance of the generations (default {CFG_SCALE})")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    common.setup(args)
    log = common.Log("ssd")
    steps, bs = args.steps or DEFAULT_STEPS, args.batch_size or DEFAULT_BATCH
    gen = torch.Generator().manual_seed(args.seed)
    cfg_scale = CFG_SCALE if args.cfg_scale is None else args.cfg_scale
    if args.model is not None:
        target, h_in, tokens, S = _wrapped_model_data(args, cfg_scale, log)
    else:
        target = load_gpt(os.path.join(args.out, "target.safetensors"), "run `python -m specdec.train target` first")[0]
        for prm in target.parameters():
            prm.requires_grad_(False)
        hidden, tokens = self_distillation_data(target, args.samples, gen, log)
        h_in = hidden[:, target.prefix_len - 1:]                  # h_t: the slot predicting token t
        S = tokens.shape[0] // 2
    heads, agree = fit_heads(target, h_in, tokens, steps=steps, batch_size=bs, gen=gen, log=log, conditional_rows=S)
    log(f"held-out argmax agreement per head (offsets {heads.offsets}): {agree}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ssd_heads.safetensors")
    save_weights(heads.cpu(), path, heads.config.to_dict(), argmax_agreement=agree, samples=args.samples,
                 train_seconds=log.elapsed(), train_cpu_seconds=log.cpu(), steps=steps,
                 **({"model": os.path.abspath(args.model)} if args.model else {}))
    log(f"saved {path}")


def read_prompt_file(path) -> list:
    """The prompts of a prompt file (--prompts of the scripts that take --model): one per line,
    text (tokenised by the model's processor) or a JSON list of token ids (for a model saved
    without a processor, or prompts tokenised beforehand)."""
    import json

    if not path or not os.path.isfile(path):
        raise SystemExit(f"--prompts: {path!r} is not a file (one prompt per line)")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("["):
                try:
                    ids = json.loads(line)
                except json.JSONDecodeError:
                    ids = None
                if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
                    raise SystemExit(f"--prompts: {path}:{n}: a line starting with '[' must be a JSON list of "
                                     "token ids >= 0")
                prompts.append(torch.tensor(ids, dtype=torch.long))
            else:
                prompts.append(line)
    if not prompts:
        raise SystemExit(f"--prompts: {path} holds no prompt")
    return prompts


def _wrapped_model_data(args, cfg_scale: float, log):
    """(target, h_in, tokens, conditional rows) distilled from a transformers model's own
    generations for the prompts of --prompts (plain AR through specdec's adapter)."""
    lines = read_prompt_file(args.prompts)
    from specdec.decoding import decode
    from specdec.decoding.common import Sampling
    from specdec.models.hf import load_pretrained

    family = load_pretrained(args.model, device=args.device)
    target = family.target
    prompts = [lines[i % len(lines)] for i in range(args.samples)]
    sampling = Sampling(cfg_scale=cfg_scale)
    out = decode("ar", family, prompts=prompts, sampling=sampling, seed=args.seed, batch_size=8,
                 progress=lambda n: log(f"generated {n}/{args.samples} images"))
    tokens = out.tokens.flatten(1)
    conditions = target.encode_prompts(prompts, None)
    with torch.no_grad():
        h_in, rows = protocol_distillation_data(target, conditions, tokens, sampling.guided)
    return target, h_in.float(), rows, tokens.shape[0]


if __name__ == "__main__":
    main()
