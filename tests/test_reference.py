"""The plain-torch reference against a naive per-query loop, and the block-range helpers (CPU)."""

import math

import pytest
import torch

from cute_attn.kernels import block_info
from cute_attn.reference import attention_reference


def naive_attention(q, k, v, causal, scale):
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, heads, seqlen_q), math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // heads_kv)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                s = torch.stack([(q[b, i, h].double() * k[b, j, hk].double()).sum() * scale for j in keys])
                m = s.max()
                p = torch.exp(s - m)
                lse[b, h, i] = m + torch.log(p.sum())
                out[b, i, h] = sum(p[n] * v[b, j, hk].double() for n, j in enumerate(keys)) / p.sum()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,heads_kv", [(5, 5, 2, 2), (7, 3, 4, 2), (3, 9, 3, 1), (1, 6, 2, 1)])
def test_reference_matches_naive_loop(causal, seqlen_q, seqlen_k, heads, heads_kv):
    torch.manual_seed(seqlen_q * 100 + seqlen_k)
    q = torch.randn(2, seqlen_q, heads, 16)
    k = torch.randn(2, seqlen_k, heads_kv, 16)
    v = torch.randn(2, seqlen_k, heads_kv, 16)
    out, lse = attention_reference(q, k, v, causal, 0.37)
    ref_out, ref_lse = naive_attention(q, k, v, causal, 0.37)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


def test_reference_rows_without_keys():
    q, k, v = torch.randn(1, 5, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = attention_reference(q, k, v, causal=True)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isinf(lse[:, :, :3]) & (lse[:, :, :3] > 0))
    assert not torch.isnan(out).any()


def visible(i, j, seqlen_q, seqlen_k, causal):
    return j < seqlen_k and (not causal or j <= i + seqlen_k - seqlen_q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (128, 128), (129, 127), (1000, 777)])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 64), (128, 128), (64, 128)])
def test_block_ranges_cover_exactly_the_visible_keys(causal, seqlen_q, seqlen_k, tile_m, tile_n):
    """Forward: blocks >= n_block_max hold no visible key; blocks below n_block_mask_start are fully
    visible to every row (so they may skip the mask)."""
    for m in range((seqlen_q + tile_m - 1) // tile_m):
        rows = range(m * tile_m, min((m + 1) * tile_m, seqlen_q))
        n_max = block_info.n_block_max(m, tile_m, tile_n, seqlen_q, seqlen_k, causal)
        n_mask = block_info.n_block_mask_start(m, tile_m, tile_n, seqlen_q, seqlen_k, causal)
        for n in range((seqlen_k + tile_n - 1) // tile_n):
            cols = range(n * tile_n, (n + 1) * tile_n)
            any_visible = any(visible(i, j, seqlen_q, seqlen_k, causal) for i in rows for j in cols)
            all_visible = all(visible(i, j, seqlen_q, seqlen_k, causal) for i in rows for j in cols)
            if any_visible:
                assert n < n_max, f"block {n} holds visible keys of Q block {m} but is skipped"
            if n < min(n_mask, n_max - 1):  # the kernel runs these without a mask
                assert all_visible, (m, n)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (128, 128), (1000, 777)])
def test_backward_block_ranges(causal, seqlen_q, seqlen_k):
    tile_m, tile_n = 64, 128
    for n in range((seqlen_k + tile_n - 1) // tile_n):
        cols = range(n * tile_n, min((n + 1) * tile_n, seqlen_k))
        m_min = block_info.m_block_min(n, tile_m, tile_n, seqlen_q, seqlen_k, causal)
        m_mask_end = block_info.m_block_mask_end(n, tile_m, tile_n, seqlen_q, seqlen_k, causal)
        for m in range((seqlen_q + tile_m - 1) // tile_m):
            rows = range(m * tile_m, min((m + 1) * tile_m, seqlen_q))
            any_visible = any(visible(i, j, seqlen_q, seqlen_k, causal) for i in rows for j in cols)
            if m < m_min:
                assert not any_visible, (n, m)
            if m >= m_mask_end:
                assert all(visible(i, j, seqlen_q, seqlen_k, causal) for i in rows for j in cols), (n, m)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,heads_kv", [(5, 5, 2, 2), (7, 3, 4, 2), (3, 9, 3, 1)])
def test_backward_reference_matches_autograd(causal, seqlen_q, seqlen_k, heads, heads_kv):
    """Unrounded, the written-out backward is autograd of the reference; rounded (bf16), it moves
    the gradients but not dV (D does not enter it)."""
    from cute_attn.reference import attention_backward_reference

    torch.manual_seed(seqlen_q * 10 + seqlen_k)
    q, k, v = (torch.randn(2, s, h, 16, dtype=torch.float64, requires_grad=True)
               for s, h in ((seqlen_q, heads), (seqlen_k, heads_kv), (seqlen_k, heads_kv)))
    dout = torch.randn(2, seqlen_q, heads, 16, dtype=torch.float64)
    out, _ = attention_reference(q, k, v, causal, 0.37, compute_dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, causal, 0.37)
    for got, want in zip(exact, grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    q16, k16, v16 = (t.detach().bfloat16() for t in (q, k, v))
    rounded = attention_backward_reference(q16, k16, v16, dout, causal, 0.37)
    unrounded = attention_backward_reference(q16, k16, v16, dout, causal, 0.37, round_out=False)
    torch.testing.assert_close(rounded[2], unrounded[2], atol=0, rtol=0)
    assert not torch.equal(rounded[0], unrounded[0])
