"""`sjd`: speculative Jacobi decoding (Teng et al., ICLR 2025), lossless in the speculative sense.

No drafter: a window of `window` future slots holds guesses, initialised uniformly at random.
Each iteration one target pass over [last committed token ; window] gives p^(j) at every slot;
the window is verified left to right with u < min(1, p^(j)(y) / p^(j-1)(y)), where p^(j-1) is the
distribution y was drawn from (`verify_grid(rule="ratio", mode="raster")`); at the first rejection
the token is resampled from norm(max(0, p^(j) - p^(j-1))) (`sample_residual`), the accepted prefix
is committed, and the rest of the window is redrawn from p^(j) (Jacobi iteration), new slots
appended at the end uniformly at random. When the whole window is accepted a bonus token is
drawn from the last output.

Batched: every image has its own window start c_b and window length n_b (shorter near the end
of the grid, 0 once finished), and the images share their target passes. A pass is as wide as the
longest window; a row with a shorter window is padded with *re-feeds* (committed tokens fed again
at their own slots, whose keys and values come out as they were, as in `speculative.padded_block`),
a finished image rides along on re-feeds only. Padded entries are never judged and draw no
uniforms: every image consumes its stream exactly as decoded alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decoding.batching import check_grid_model, run_batches
from specdec.decoding.compiled import record_compile_s, runner_for
from specdec.decoding.draws import draw
from specdec.decoding.runner import ModelRunner
from specdec.decoding.speculative import padded_block
from specdec.decoding.streams import ImageStreams
from specdec.decoding.uploads import to_device
from specdec.ops.verification import sample_residual_unchecked, verify_grid_unchecked
from specdec.settings import RunSettings, check_int


@dataclass(frozen=True)
class SJDOptions:
    window: int = 16   #: future slots guessed and verified per pass

    def __post_init__(self):
        check_int(self.window, "window", 1)


def _long(values, device) -> torch.Tensor:
    """Host ints -> an int64 tensor on `device` (a host-to-device copy, no read-back)."""
    return to_device(values, device, torch.long)


def _draw_rows(probs, streams: ImageStreams, counts, backend):
    """One token per entry of probs [B, L, V], the first counts[b] rows of image b from its own
    stream (the rest are padding, drawn with zeros that consume nothing) -> int64 [B, L]."""
    B, L, V = probs.shape
    u = to_device(streams.rand_padded(counts, L), probs.device).view(-1)
    out = sample_residual_unchecked(probs.reshape(-1, V), None, u, backend)
    return out.tokens.long().view(B, L)


@torch.no_grad()
def sjd_grid(runner: ModelRunner, classes, gen: ImageStreams, stats, *, window: int) -> torch.Tensor:
    """Decode the batch `classes` with one stream per image (`gen`); returns int64 [B, H*W]."""
    B = classes.shape[0]
    HW = runner.H * runner.W
    dev = runner.device
    first = runner.prefill(classes)
    V = first.cond.shape[-1]
    x = torch.zeros(B, HW, dtype=torch.long, device=dev)
    x[:, 0] = draw(runner.probs(first)[:, 0], gen, runner.backend)
    uniform = torch.full((V,), 1.0 / V, device=dev)
    # Host state (advanced from the one read per pass): window starts and window lengths.
    c_host = [1] * B
    n_host = [min(window, HW - 1)] * B
    # The windows [B, max n]: guesses y for positions c_b .. c_b + n_b - 1 and the distribution
    # each was drawn from (padding entries beyond n_b are never judged).
    q = uniform.expand(B, n_host[0], V).clone()
    y = _draw_rows(q, gen, n_host, runner.backend)
    ar_b = torch.arange(B, device=dev)
    while any(nb > 0 for nb in n_host):
        L = y.shape[1]                                                        # = max n_b
        c, n = _long(c_host, dev), _long(n_host, dev)
        j = torch.arange(L + 1, device=dev)[None]
        # Row b feeds [x_{c-1} ; y_b] at c_b - 1 .. c_b + n_b - 1, then re-feeds c_b - 2, c_b - 3 ...
        pos = padded_block(c - 1, n + 1, L + 1)
        fed_y = (j >= 1) & (j <= n[:, None])
        tokens = torch.where(fed_y, torch.cat([y[:, :1], y], 1), x.gather(1, pos))
        out = runner.forward(tokens, pos)                                     # output j: dist of c_b + j
        p = runner.probs(out)                                                 # [B, L + 1, V]
        p_tok = p[:, :L].gather(2, y[..., None])[..., 0]
        q_tok = q.gather(2, y[..., None])[..., 0]
        ragged = any(nb != L for nb in n_host)
        valid = (j[:, :L] < n[:, None]) if ragged else None
        u = to_device(gen.rand_padded(n_host, L), dev)
        verdict = verify_grid_unchecked(p_tok.view(B, 1, L), q_tok.view(B, 1, L), "ratio", mode="raster",
                                        uniforms=u.view(B, 1, L), valid=None if valid is None else valid.view(B, 1, L),
                                        backend=runner.backend)
        a = torch.minimum(verdict.first_reject.long(), n)
        # The one host read of the pass: how far each window got. It decides every image's next
        # window (its length is the number of uniforms the image draws) and the next pass's shape.
        a_host = a.tolist()
        amap = torch.zeros(B, HW, dtype=torch.bool)
        for b, (cb, ab) in enumerate(zip(c_host, a_host)):
            amap[b, cb:cb + ab] = True
        stats.acceptance_maps.append(amap.view(B, runner.H, runner.W))
        stats.extra.setdefault("drafted", []).append(sum(n_host))
        stats.extra.setdefault("accepted", []).append(sum(a_host))
        # Commit the accepted prefixes (rows write their last committed token back elsewhere).
        jl = j[:, :L]
        kept = jl < a[:, None]
        dpos = padded_block(c, n, L)                                          # distinct per row
        x.scatter_(1, torch.where(kept, dpos, (c - 1)[:, None].expand(-1, L)),
                   torch.where(kept, y, x.gather(1, (c - 1)[:, None]).expand(-1, L)))
        fix = [b for b in range(B) if a_host[b] < n_host[b]]                  # a correction at c + a
        bonus = [b for b in range(B) if a_host[b] == n_host[b] > 0 and c_host[b] + n_host[b] < HW]
        if fix:
            rr, aa = _long(fix, dev), a[_long(fix, dev)]
            u_fix = to_device(gen.rand_counts([int(b in fix) for b in range(B)]), dev)
            tok = sample_residual_unchecked(p[rr, aa], q[rr, aa], u_fix, runner.backend).tokens.long()
            x[rr, c[rr] + aa] = tok
            runner.invalidate_where(dpos, (jl >= a[:, None]) & (jl < n[:, None]))   # stale guesses
        if bonus:
            rr = _long(bonus, dev)
            u_bonus = to_device(gen.rand_counts([int(b in bonus) for b in range(B)]), dev)
            tok = sample_residual_unchecked(p[rr, n[rr]], None, u_bonus, runner.backend).tokens.long()
            x[rr, c[rr] + n[rr]] = tok
        new_c = [cb + ab + (1 if (ab < nb or cb + nb < HW) and nb > 0 else 0)
                 for cb, ab, nb in zip(c_host, a_host, n_host)]
        new_n = [min(window, HW - cb) for cb in new_c]
        L_next = max(new_n)
        if L_next == 0:
            break
        # Jacobi step: after a correction at c + a the window's slots c + a + 1 .. c + n follow
        # this pass's p (outputs a + 1 .. n); slots beyond (and after a bonus token) are fresh.
        jn = torch.arange(L_next, device=dev)[None]
        from_p = (a < n)[:, None] & (jn < (n - a)[:, None])
        src = (a[:, None] + 1 + jn).clamp(max=L)
        q = torch.where(from_p[..., None], p[ar_b[:, None], src], uniform)
        y = _draw_rows(q, gen, new_n, runner.backend)
        c_host, n_host = new_c, new_n
    return x


def decode(target, conditions, *, tokenizer=None, options: SJDOptions = SJDOptions(),
           run: RunSettings = RunSettings()):
    """Speculative Jacobi decoding of `target`. With `run.compile` every target pass runs through
    compiled graphs padded to bucket widths (specdec.decoding.compiled)."""
    check_grid_model(target, "target")
    sampling = run.sampling_or_default

    def decode_batch(cls, gen, stats):
        runner = runner_for(target, sampling, cls.shape[0], run.backend, compile=run.compile)
        x = sjd_grid(runner, cls, gen, stats, window=options.window)
        stats.target_forwards = runner.forwards * cls.shape[0]     # a shared pass counts once per image
        stats.target_tokens_fed = runner.fed * cls.shape[0]
        if run.compile:
            record_compile_s(stats, runner)
        return x

    return run_batches("sjd", target, conditions, decode_batch, run, tokenizer)


OPTIONS = SJDOptions
PRESETS = {}
