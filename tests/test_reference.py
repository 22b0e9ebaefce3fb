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


OPTIONS = [  # FlashAttention's window / softcap / ALiBi options, alone and together
    dict(window_size=(2, -1)),
    dict(window_size=(3, 1)),
    dict(window_size=(-1, 0)),
    dict(window_size=(0, 0)),
    dict(softcap=1.5),
    dict(alibi_slopes=torch.tensor([0.5, 0.125, 0.25, 1.0])),
    dict(window_size=(4, 2), softcap=2.0, alibi_slopes=torch.tensor([[0.3, 0.1, 0.2, 0.4], [0.6, 0.7, 0.8, 0.9]])),
]


def naive_with_options(q, k, v, causal, scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """One query and key at a time, straight from the option definitions."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    left, right = window_size
    right = 0 if causal else right
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, heads, seqlen_q), math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // heads_kv)
            for i in range(seqlen_q):
                d = i + seqlen_k - seqlen_q
                keys = [j for j in range(seqlen_k) if (left < 0 or j >= d - left) and (right < 0 or j <= d + right)]
                if not keys:
                    continue
                s = []
                for j in keys:
                    x = (q[b, i, h].double() * k[b, j, hk].double()).sum() * scale
                    if softcap > 0:
                        x = softcap * torch.tanh(x / softcap)
                    if alibi_slopes is not None:
                        slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                        x = x - float(slope) * abs(d - j)
                    s.append(x)
                s = torch.stack(s)
                lse[b, h, i] = torch.logsumexp(s, 0)
                p = torch.exp(s - lse[b, h, i])
                out[b, i, h] = sum(p[n] * v[b, j, hk].double() for n, j in enumerate(keys))
    return out, lse


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(6, 6), (7, 3), (3, 9)])
def test_reference_options_match_naive_loop(options, causal, seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q * 100 + seqlen_k)
    q = torch.randn(2, seqlen_q, 4, 8)
    k, v = torch.randn(2, seqlen_k, 2, 8), torch.randn(2, seqlen_k, 2, 8)
    out, lse = attention_reference(q, k, v, causal, 0.37, **options)
    ref_out, ref_lse = naive_with_options(q, k, v, causal, 0.37, **options)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("causal", [False, True])
def test_backward_reference_options_match_autograd(options, causal):
    from cute_attn.reference import attention_backward_reference

    torch.manual_seed(7)
    q, k, v = (torch.randn(2, s, h, 8, dtype=torch.float64, requires_grad=True)
               for s, h in ((7, 4), (9, 2), (9, 2)))
    dout = torch.randn(2, 7, 4, 8, dtype=torch.float64)
    out, _ = attention_reference(q, k, v, causal, 0.37, compute_dtype=torch.float64, **options)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, causal, 0.37, **options)
    for got, want in zip(exact, grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_varlen_reference_matches_each_sequence():
    from cute_attn.reference import attention_varlen_reference

    torch.manual_seed(3)
    lens_q, lens_k = [5, 0, 1, 9], [5, 3, 7, 2]  # an empty query sequence, more queries than keys
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 8)
    k, v = torch.randn(sum(lens_k), 2, 8), torch.randn(sum(lens_k), 2, 8)
    slopes = torch.rand(4, 4)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, True, 0.3, window_size=(3, -1), alibi_slopes=slopes)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    for b in range(4):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        ref_out, ref_lse = naive_with_options(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], True, 0.3,
                                              window_size=(3, -1), alibi_slopes=slopes[b])
        torch.testing.assert_close(out[q0:q1].double(), ref_out[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(lse[:, q0:q1]), torch.isinf(ref_lse[0]))


def visible_window(i, j, seqlen_q, seqlen_k, left, right):
    d = i + seqlen_k - seqlen_q
    return j < seqlen_k and (left is None or j >= d - left) and (right is None or j <= d + right)


WINDOWS = [(None, None), (None, 0), (0, 0), (5, None), (5, 0), (100, 3), (200, 200), (0, None), (3, 130)]


@pytest.mark.parametrize("left,right", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (129, 127), (700, 555)])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 64), (64, 128)])
def test_window_block_ranges(left, right, seqlen_q, seqlen_k, tile_m, tile_n):
    """Forward and backward block ranges under a sliding window, against every (query, key) pair:
    skipped blocks hold no visible key, and blocks run without a mask are fully visible on the
    sides they skip (the seqlen_k end is the last block's own mask)."""
    args = (tile_m, tile_n, seqlen_q, seqlen_k)
    num_m, num_n = (seqlen_q + tile_m - 1) // tile_m, (seqlen_k + tile_n - 1) // tile_n

    def rows(m):
        return range(m * tile_m, min((m + 1) * tile_m, seqlen_q))

    def cols(n):
        return range(n * tile_n, min((n + 1) * tile_n, seqlen_k))

    def any_seen(m, n):
        return any(visible_window(i, j, seqlen_q, seqlen_k, left, right) for i in rows(m) for j in cols(n))

    def left_clear(m, n):  # no row of m has left a key of n behind
        return left is None or all(j >= i + seqlen_k - seqlen_q - left for i in rows(m) for j in cols(n))

    def right_clear(m, n):  # every key of n is at or before every row's right edge
        return right is None or all(j <= i + seqlen_k - seqlen_q + right for i in rows(m) for j in cols(n))

    for m in range(num_m):
        n_min = block_info.n_block_min(m, *args, window_left=left)
        n_max = block_info.n_block_max(m, *args, False, window_right=right)
        n_left = block_info.n_block_left_mask_end(m, *args, window_left=left)
        n_right = block_info.n_block_mask_start(m, *args, False, window_right=right)
        for n in range(num_n):
            if any_seen(m, n):
                assert n_min <= n < n_max, (m, n)
            if n >= n_left:
                assert left_clear(m, n), (m, n)
            if n < n_right:
                assert right_clear(m, n), (m, n)
        if any(any_seen(m, n) for n in range(num_n)):  # tight: the range's ends hold visible keys
            assert any_seen(m, n_min) and any_seen(m, n_max - 1), (m, n_min, n_max)
    for n in range(num_n):
        m_min = block_info.m_block_min(n, *args, False, window_right=right)
        m_max = block_info.m_block_max(n, *args, window_left=left)
        m_right_end = block_info.m_block_mask_end(n, *args, False, window_right=right)
        m_left_start = block_info.m_block_left_mask_start(n, *args, window_left=left)
        for m in range(num_m):
            if any_seen(m, n):
                assert m_min <= m < m_max, (n, m)
            if m >= m_right_end:
                assert right_clear(m, n), (n, m)
            if m < m_left_start:
                assert left_clear(m, n), (n, m)
        if any(any_seen(m, n) for m in range(num_m)):
            assert any_seen(m_min, n) and any_seen(m_max - 1, n), (n, m_min, m_max)


@pytest.mark.parametrize("mode", ["none", "causal", "window"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (129, 127), (700, 555), (1000, 1000)])
@pytest.mark.parametrize("tile_m", [64, 128])
def test_sm90_deterministic_dq_turns(mode, seqlen_q, seqlen_k, tile_m):
    """Deterministic SM90 backward: the K/V blocks that visit a Q block (backward_walk) hold the
    semaphore turns 0..count-1 exactly once, each turn's holder launched (grid order) before the
    next one's, so no CTA waits for one that has not started."""
    from cute_attn.kernels.sm90.backward import dq_semaphore_turn, kv_block_of_cta

    tile_n = 128
    windows = [(None, None)] if mode != "window" else [(0, 0), (5, 0), (100, 3), (200, 200), (3, 130), (2**30, 0)]
    num_n = (seqlen_k + tile_n - 1) // tile_n
    for left, right in windows:
        causal = mode == "causal"
        turns = {}
        for cta in range(num_n):
            n = kv_block_of_cta(cta, tile_n, seqlen_k, reverse=causal)
            m_min, m_max, _, _ = block_info.backward_walk(n, tile_m, tile_n, seqlen_q, seqlen_k, causal, left, right)
            for m in range(m_min, m_max):
                turn = dq_semaphore_turn(m, n, tile_m, tile_n, seqlen_q, seqlen_k, causal, left)
                turns.setdefault(m, []).append((turn, cta))
        for m, held in turns.items():
            held.sort()
            assert [t for t, _ in held] == list(range(len(held))), (left, right, m, held)
            assert all(a[1] < b[1] for a, b in zip(held, held[1:])), (left, right, m, held)
