"""`sjd`: speculative Jacobi decoding (Teng et al., ICLR 2025), lossless in the speculative sense.

No drafter: a window of `window` future slots holds guesses, initialised uniformly at random.
Each iteration one target pass over [last committed token ; window] gives p^(j) at every slot;
the window is verified left to right with u < min(1, p^(j)(y) / p^(j-1)(y)), where p^(j-1) is the
distribution y was drawn from (`verify_grid(rule="ratio", mode="raster")`); at the first rejection
the token is resampled from norm(max(0, p^(j) - p^(j-1))) (`sample_residual`), the accepted prefix
is committed, and the rest of the window is redrawn from p^(j) (Jacobi iteration), new slots
appended at the end uniformly at random. When the whole window is accepted a bonus token is
drawn from the last output.

Images advance by different amounts per iteration: a batch is decoded one image at a time
(batch_size is accepted; each image draws from its own stream, so tokens equal batch_size=1).
"""
from __future__ import annotations

import torch

from specdec.decoding.common import (ModelRunner, Sampling, check_grid_model, draw, draw_residual, one_image_at_a_time,
                                     run_batches, verify)


@torch.no_grad()
def sjd_grid(runner: ModelRunner, classes, gen, stats, *, window: int) -> torch.Tensor:
    HW = runner.H * runner.W
    dev = runner.device
    first = runner.prefill(classes)
    V = first.cond.shape[-1]
    x = torch.zeros(1, HW, dtype=torch.long, device=dev)
    x[0, 0] = draw(runner.probs(first)[:, 0], gen, runner.backend)[0]
    c = 1
    uniform = torch.full((V,), 1.0 / V, device=dev)
    # The window: guesses y for positions c .. c+L-1 and the distribution each was drawn from.
    L = min(window, HW - c)
    y = draw(uniform.expand(L, V), gen, runner.backend)
    q = uniform.expand(L, V).clone()
    while c < HW:
        n = y.shape[0]
        pos = torch.arange(c - 1, c + n, device=dev)
        out = runner.forward(torch.cat([x[0, c - 1:c], y])[None], pos)        # dists of c .. c+n
        p = runner.probs(out)[0]                                               # [n + 1, V]
        p_tok = p[:n].gather(1, y[:, None])[:, 0]
        q_tok = q.gather(1, y[:, None])[:, 0]
        verdict = verify(p_tok.view(1, 1, n), q_tok.view(1, 1, n), rule="ratio", mode="raster", gen=gen,
                         backend=runner.backend)
        a = int(verdict.first_reject[0])
        amap = torch.zeros(HW, dtype=torch.bool)
        amap[c:c + a] = True
        stats.acceptance_maps.append(amap.view(runner.H, runner.W))
        stats.extra.setdefault("drafted", []).append(n)
        stats.extra.setdefault("accepted", []).append(a)
        x[0, c:c + a] = y[:a]
        if a < n:
            x[0, c + a] = draw_residual(p[a:a + 1], q[a:a + 1], gen, runner.backend)[0]
            runner.invalidate(torch.arange(c + a, c + n, device=dev))         # stale guesses
            new_c = c + a + 1
            # Jacobi step: the slots after the correction are redrawn from this pass's p.
            rest_p = p[a + 1:n + 1]
        else:
            new_c = c + n
            rest_p = p[n:n + 1]                                                # the bonus token's p
            if new_c < HW:
                x[0, new_c] = draw(rest_p, gen, runner.backend)[0]
                new_c += 1
                rest_p = rest_p[:0]
        c = new_c
        if c >= HW:
            break
        L = min(window, HW - c)
        rest_p = rest_p[:L]
        fresh = L - rest_p.shape[0]
        q = torch.cat([rest_p, uniform.expand(fresh, V)])
        y = draw(q, gen, runner.backend)
    return x


def decode(target, classes, *, window: int = 16, seed: int = 0, first_index: int = 0, sampling: Sampling = Sampling(), tokenizer=None,
           backend=None, progress=None, batch_size: int = 1):
    check_grid_model(target, "target")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")

    def run(cls, gen, stats):
        runner = ModelRunner(target, sampling, batch=1, backend=backend)
        x = sjd_grid(runner, cls, gen, stats, window=window)
        stats.target_forwards = runner.forwards
        return x

    return run_batches("sjd", target, classes, seed, one_image_at_a_time(run), batch_size=batch_size,
                       tokenizer=tokenizer, progress=progress,
                       first_index=first_index)
