"""AWQ (Lin et al., 2023), the way AutoAWQ does it: for a group of linear layers that read the
same input `x`, search per-input-channel scales `s`, multiply the layers' weight columns by `s`
and fold `1 / s` into whatever produced `x` (the RMSNorm before q/k/v and gate/up, v_proj
before o_proj, up_proj before down_proj), so that the float model is unchanged but the salient
input channels (large mean |x|) get a finer grid. Then clip each group's range (auto_clip).

Scale search (AutoAWQ's `_search_best_scale`, duo scaling): `x_mean = mean |x|` per channel,
`w_mean` = mean over the group's output rows of `|w| / max |w|` of each quantization group;
for `alpha = i / n_grid`, `i = 0 .. n_grid - 1`:
`s = x_mean^alpha / (w_mean^(1 - alpha) + 1e-4)`, clamped >= 1e-4, normalised by
`sqrt(max(s) min(s))`; the candidate's loss is the mean squared error of the block's output
(`forward(quantized weights)` against the float output) on calibration inputs. `s = 1` (plain
round to nearest) is also a candidate, so the search never does worse than RTN on its own
objective (AutoAWQ's duo-scaling grid does not contain it).

Clip search (AutoAWQ's `_compute_best_clip`): per output row and quantization group, shrink
the weight's max |w| by `1 - i / n_grid` for `i < max_shrink * n_grid`, clamp, quantize, and
keep the shrink with the lowest squared error of that group's partial output `x_g . w_g` over
`n_tokens` sampled calibration tokens. AutoAWQ skips q_proj / k_proj (their errors are seen
through the softmax, not linearly); so does the pipeline here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch



def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """AutoAWQ's `w_mean`: per input channel, the mean of `|w| / group max |w|` over rows."""
    w = torch.cat(weights).to(torch.float32)
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    g = w.abs().reshape(out, k // gs, gs)
    return (g / (g.amax(-1, keepdim=True) + 1e-6)).reshape(out, k).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scales(x_mean: torch.Tensor, weights: dict[str, torch.Tensor], forward: Callable[[dict], torch.Tensor],
                  reference: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor], group_size: int,
                  n_grid: int = 20) -> tuple[torch.Tensor, float, list[tuple[float | None, float]]]:
    """Best scales `s [in]` for the linears `weights` (`{name: W [out, in]}`, all reading the
    same input whose per-channel mean |x| is `x_mean`). `forward(ws)` runs the block on the
    calibration inputs with `ws` (scaled-quantized-unscaled weights) in place of `weights`;
    `reference` is its float output; `quantize(W)` is the fake quantizer (`grid.fake_quantize`
    with the checkpoint's bits / group size / symmetry). Returns (s, its loss, [(alpha or None for s = 1, loss)])."""
    w_mean = weight_mean(list(weights.values()), group_size)
    x_mean = x_mean.to(torch.float32)
    history: list[tuple[float | None, float]] = []
    best_s, best_loss = None, float("inf")
    candidates: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones_like(x_mean))]
    candidates += [(i / n_grid, None) for i in range(n_grid)]
    for alpha, s in candidates:
        if s is None:
            s = candidate_scales(x_mean, w_mean, alpha)
        trial = {n: quantize(w * s) / s for n, w in weights.items()}
        loss = float((forward(trial) - reference).float().pow(2).mean())
        history.append((alpha, loss))
        if loss < best_loss:
            best_s, best_loss = s, loss
    return best_s, best_loss, history


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor], group_size: int,
                n_grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512, rows_per_batch: int = 256) -> torch.Tensor:
    """Per output row and group, the best max |w| (`[out, groups]`) after AutoAWQ's shrink grid,
    for `w [out, in]` reading inputs `x [tokens, in]`."""
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    ng = k // gs
    x = x.reshape(-1, k).to(torch.float32)
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    xg = x.reshape(-1, ng, gs).transpose(0, 1)  # [groups, tokens, gs]
    best = torch.empty(out, ng)
    for r0 in range(0, out, rows_per_batch):
        wb = w[r0:r0 + rows_per_batch].to(torch.float32)
        wg = wb.reshape(-1, ng, gs).transpose(0, 1)  # [groups, rows, gs]
        org_max = wg.abs().amax(-1, keepdim=True)  # [groups, rows, 1]
        ref = torch.bmm(xg, wg.transpose(1, 2))  # [groups, tokens, rows]
        min_err = torch.full(org_max.shape[:2], float("inf"))
        best_max = org_max[..., 0].clone()
        for i in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i / n_grid)
            cur = torch.maximum(torch.minimum(wg, max_val), -max_val)
            q = quantize(cur.transpose(0, 1).reshape(-1, k))
            q = q.reshape(-1, ng, gs).transpose(0, 1)
            err = (torch.bmm(xg, q.transpose(1, 2)) - ref).pow(2).mean(1)  # [groups, rows]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better, max_val[..., 0], best_max)
        best[r0:r0 + rows_per_batch] = best_max.t()
    return best


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    g = w.reshape(out, k // gs, gs)
    m = max_val.unsqueeze(-1)
    return torch.maximum(torch.minimum(g, m), -m).reshape(out, k)
