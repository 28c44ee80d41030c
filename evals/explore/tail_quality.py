"""Exploration (issue 20): sparse decode attention plus an estimate of the blocks it skips.

The attention over the selected blocks is exact; every skipped chunk of ``TAIL_G`` tokens (in
the cache's physical order: the context's blocks are contiguous) enters the softmax as one
pseudo-token with the chunk's mean key and mean value, weighted by its token count:
``n_c exp(q . mean_k_c * scale)`` (a lower bound of the chunk's mass, by Jensen). ``TAIL_G=0``
is plain sparse attention. Runs evals/sparse_quality.py with the reference model's
``paged_attention`` replaced (only where the harness measures mass, i.e. sparse rows).

    TAIL_G=16 .venv/bin/python evals/explore/tail_quality.py --contexts 2048 --docs 1 ...
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ucm.reference.llama as llama  # noqa: E402

TAIL_G = int(os.environ.get("TAIL_G", "0"))
TAIL_BITS = int(os.environ.get("TAIL_BITS", "0"))    # quantize the chunk means (0: exact)
_orig = llama.paged_attention


def _q(x, bits):
    if not bits:
        return x
    m = 2 ** (bits - 1) - 1
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / m
    return (x / s).round().clamp(-m, m) * s


def tailed(q, k_cache, v_cache, block_table, seq_lens, scale=None, full=None):
    if full is None or TAIL_G <= 0:
        return _orig(q, k_cache, v_cache, block_table, seq_lens, scale, full)
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    used = llama._used_blocks(block_table, full[0])
    N = used * bs
    keys = k_cache[:used].reshape(N, Hkv, D).float()
    vals = v_cache[:used].reshape(N, Hkv, D).float()
    qg = q.reshape(B, Hkv, G, D).float()
    scores = torch.einsum("bkgd,nkd->bkgn", qg, keys) * scale
    if block_table.dim() == 3:
        mask = llama._token_mask(block_table.reshape(B * Hkv, -1), seq_lens.reshape(-1), used,
                                 bs).reshape(B, Hkv, 1, N)
    else:
        mask = llama._token_mask(block_table, seq_lens, used, bs)[:, None, None, :]
    dmask = llama._token_mask(full[0], full[1], used, bs)[:, None, None, :]
    tail = (dmask & ~mask).expand(B, Hkv, 1, N)[:, :, 0].float()          # [B, Hkv, N]
    C = (N + TAIL_G - 1) // TAIL_G
    pad = C * TAIL_G - N
    tw = torch.nn.functional.pad(tail, (0, pad)).reshape(B, Hkv, C, TAIL_G)
    kp = torch.nn.functional.pad(keys.permute(1, 0, 2), (0, 0, 0, pad)).reshape(Hkv, C, TAIL_G, D)
    vp = torch.nn.functional.pad(vals.permute(1, 0, 2), (0, 0, 0, pad)).reshape(Hkv, C, TAIL_G, D)
    cnt = tw.sum(-1)                                                       # [B, Hkv, C]
    kbar = torch.einsum("bhct,hctd->bhcd", tw, kp) / cnt.clamp_min(1)[..., None]
    vbar = torch.einsum("bhct,hctd->bhcd", tw, vp) / cnt.clamp_min(1)[..., None]
    kbar, vbar = _q(kbar, TAIL_BITS), _q(vbar, TAIL_BITS)
    tl = torch.einsum("bkgd,bkcd->bkgc", qg, kbar) * scale                 # [B, Hkv, G, C]
    tl = tl + torch.log(cnt.clamp_min(1e-30))[:, :, None, :]
    tl = tl.masked_fill((cnt == 0)[:, :, None, :], float("-inf"))
    s = scores.masked_fill(~mask, float("-inf"))
    m = torch.maximum(s.amax(-1), tl.amax(-1))[..., None]
    ps, pt = torch.exp(s - m), torch.exp(tl - m)
    num = torch.einsum("bkgn,nkd->bkgd", ps, vals) + torch.einsum("bkgc,bkcd->bkgd", pt, vbar)
    den = ps.sum(-1) + pt.sum(-1)
    out = (num / den[..., None]).reshape(B, Hq, D).to(q.dtype)
    dense = torch.softmax(scores.masked_fill(~dmask, float("-inf")), -1)
    return out, (dense * mask).sum(-1).mean(dim=(1, 2))


llama.paged_attention = tailed

from evals.sparse_quality import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
