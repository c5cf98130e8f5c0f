"""How a row's token is drawn (steps 4-5 of layers/sampler.py's order): the greedy argmax
(`argmax_rows`, the fused CPU kernel where it applies), or temperature, min-p, top-k / top-p and
one draw from the softmax by the exponential race, seeded per sequence (`make_generator`).
Apart from the edits before it because these turn the edited logits into a token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.kernels import fused_ops_kernel

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded sequence. One on the logits' device is fastest; a CPU
    generator also works with GPU logits (its draws are copied over), and then a seed gives the
    same draws on every device.

    For n > 1 with a seed, give sample i the seed `seed + i` (vLLM's choice) so that the samples
    differ but stay reproducible."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as `argmax`; a row with a NaN: its first
    NaN, as torch's `max`). Float32 rows on CPU go through kernels/fused_ops.c's
    `argmax_rows_f32` (256 x 49,152: 10.4 ms a step with torch's `max(dim)` on a 2-core Xeon);
    elsewhere `max(dim).indices`, because torch's CPU `argmax` over a row of a vocabulary is 4x
    slower than its `max` with indices (15.7 vs 3.8 ms on the 2-core Zen5; benchmarks/profile_step)."""
    if (x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]
            and x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()):
        kernel = fused_ops_kernel()
        if kernel is not None:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernel.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                               torch.get_num_threads())
            return out
    return x.max(dim=-1).indices


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Masks (-inf) tokens outside the top-k and outside the nucleus top-p. `k` 0 = off,
    `p` 1.0 = off, per row. Sorts only when top-p is used."""
    vocab_size = logits.shape[1]
    if p is None:
        if k is None:
            return logits
        return _apply_top_k_only(logits, k)

    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k_eff = torch.where(k > 0, k.clamp(max=vocab_size), vocab_size)
        # The k-th largest value; everything strictly below it goes (ties are kept).
        thresh = logits_sort.gather(1, (vocab_size - k_eff).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < thresh, _NEG_INF)
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    top_p_mask = probs_sum <= (1 - p).unsqueeze(1)
    top_p_mask[:, -1] = False  # always keep the most likely token
    top_p_mask &= (p < 1.0).unsqueeze(1)  # rows with top-p off stay bit-for-bit unchanged
    logits_sort.masked_fill_(top_p_mask, _NEG_INF)
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    off = (k <= 0) | (k >= vocab_size)
    k_eff = k.masked_fill(off, 1)
    max_k = int(k_eff.max())
    thresh = logits.topk(max_k, dim=1).values.gather(1, (k_eff - 1).unsqueeze(1))
    thresh.masked_fill_(off.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < thresh, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < thresh, _NEG_INF)


def random_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p (vLLM's order), then one draw per row
    (`generators[i]` for a seeded row i, the default generator for the others). `logits` is
    modified."""
    gens = generators
    logits.div_(temperatures.unsqueeze(1))
    if bool((min_ps > 0.0).any()):
        logits = apply_min_p(logits, min_ps)
    use_k = bool((top_ks > 0).any())
    use_p = bool((top_ps < 1.0).any())
    if use_k or use_p:
        logits = apply_top_k_top_p(logits, top_ks if use_k else None, top_ps if use_p else None)
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    if any(g is None for g in gens):
        q.exponential_()
    for i, g in enumerate(gens):
        if g is None:
            continue
        if g.device == q.device:
            q[i].exponential_(generator=g)
        else:  # e.g. a CPU generator with GPU logits: draw where the generator lives
            q[i] = torch.empty(q.shape[1], device=g.device).exponential_(generator=g).to(q.device)
    # Exp(1) can return exactly 0 with tiny probability; keep 0/0 (masked tokens) out of reach.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return argmax_rows(probs.div_(q))
