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
    # P and dS rounded as the kernels feed their products: a no-op in float64, a few bf16 units
    # in the last place otherwise, in every gradient
    same = attention_backward_reference(q.detach(), k.detach(), v.detach(), dout, causal, 0.37, round_operands=True)
    for got, want in zip(same, exact):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    operands = attention_backward_reference(q16, k16, v16, dout, causal, 0.37, round_operands=True)
    for got, want in zip(operands, rounded):
        assert not torch.equal(got, want)
        assert (got - want).abs().max() <= 2**-6 * want.abs().max()
    # a given O (a kernel's forward output) in place of the reference's own rounded one
    out16 = attention_reference(q16, k16, v16, causal, 0.37)[0]
    given = attention_backward_reference(q16, k16, v16, dout, causal, 0.37, out=out16)
    for got, want in zip(given, rounded):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    fp32 = attention_backward_reference(q16, k16, v16, dout, causal, 0.37, round_operands=True, precision=torch.float32)
    for got, want in zip(fp32, operands):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    shifted = attention_backward_reference(q16, k16, v16, dout, causal, 0.37, out=out16 + 0.25)
    torch.testing.assert_close(shifted[2], rounded[2], atol=0, rtol=0)  # D does not enter dV
    assert not torch.equal(shifted[0], given[0])


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


# ---------------------------------------------------------------------------- KV-cache decode
def complex_rotary(x, angles, positions, rotary_dim, interleaved):
    """x rotated as complex numbers: each pair (a, b) is a + ib, multiplied by e^(i * angle)."""
    half = rotary_dim // 2
    xd = x.double()
    rot = xd[..., :rotary_dim]
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        z = torch.complex(rot[..., :half], rot[..., half:])
    theta = angles.double()[positions.long()][:, :, None, :]
    z = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, xd[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_rotary_reference_matches_complex_formula(interleaved, rotary_dim):
    from cute_attn.reference import apply_rotary_reference

    torch.manual_seed(rotary_dim + interleaved)
    x = torch.randn(2, 5, 3, 16)
    angles = torch.rand(20, rotary_dim // 2) * 2 * math.pi
    positions = torch.randint(0, 20, (2, 5))
    got = apply_rotary_reference(x, torch.cos(angles), torch.sin(angles), positions, interleaved)
    want = complex_rotary(x, angles, positions, rotary_dim, interleaved)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])  # the rest untouched
    # in bf16: float32 math, rounded once
    xb = x.bfloat16()
    got_b = apply_rotary_reference(xb, torch.cos(angles).bfloat16(), torch.sin(angles).bfloat16(), positions,
                                   interleaved)
    want_b = apply_rotary_reference(xb.float(), torch.cos(angles).bfloat16().float(),
                                    torch.sin(angles).bfloat16().float(), positions, interleaved).bfloat16()
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, want_b)


def kv_case(batch=4, seqlen_q=3, heads=4, heads_kv=2, d=16, seqlen_cache=24, seqlen_new=0, batch_cache=None,
            seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g)
    k_cache = torch.randn(batch_cache or batch, seqlen_cache, heads_kv, d, generator=g)
    v_cache = torch.randn(batch_cache or batch, seqlen_cache, heads_kv, d, generator=g)
    k = torch.randn(batch, seqlen_new, heads_kv, d, generator=g) if seqlen_new else None
    v = torch.randn(batch, seqlen_new, heads_kv, d, generator=g) if seqlen_new else None
    return q, k_cache, v_cache, k, v


def to_paged(k_cache, v_cache, page_size, extra_pages=3, seed=0):
    """The same caches, paged through a shuffled block_table; unused pages hold other values."""
    g = torch.Generator().manual_seed(seed)
    batch, seqlen_cache, heads_kv, d = k_cache.shape
    pages = seqlen_cache // page_size
    num_pages = batch * pages + extra_pages
    table = torch.randperm(num_pages, generator=g)[:batch * pages].view(batch, pages).to(torch.int32)
    k_paged = torch.randn(num_pages, page_size, heads_kv, d, generator=g)
    v_paged = torch.randn(num_pages, page_size, heads_kv, d, generator=g)
    k_paged[table.long()] = k_cache.view(batch, pages, page_size, heads_kv, d)
    v_paged[table.long()] = v_cache.view(batch, pages, page_size, heads_kv, d)
    return k_paged, v_paged, table


def from_paged(cache, table):
    return cache[table.long()].flatten(1, 2)


KV_OPTIONS = [dict(), dict(window_size=(5, 2)), dict(softcap=1.5, alibi_slopes=torch.rand(4, 4)),
              dict(window_size=(3, -1), alibi_slopes=torch.tensor([0.5, 0.125, 0.25, 1.0]))]


@pytest.mark.parametrize("options", KV_OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_reference_equals_sliced_cache(options, causal):
    from cute_attn.reference import attention_kvcache_reference

    q, k_cache, v_cache, _, _ = kv_case()
    lengths = torch.tensor([0, 1, 24, 9], dtype=torch.int32)
    saved = k_cache.clone(), v_cache.clone()
    out, lse, k_after, v_after = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=lengths,
                                                             softmax_scale=0.3, causal=causal, **options)
    assert out.dtype == torch.float32 and lse.shape == (4, 4, 3)
    assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache) and k_after is not k_cache
    assert torch.equal(saved[0], k_cache) and torch.equal(saved[1], v_cache)
    slopes = options.get("alibi_slopes")
    for b, n in enumerate(lengths.tolist()):
        opts = dict(options)
        if slopes is not None and slopes.dim() == 2:
            opts["alibi_slopes"] = slopes[b]
        ref, ref_lse = attention_reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal, 0.3, **opts)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-6, rtol=1e-6)
        assert torch.equal(torch.isinf(lse[b:b + 1]), torch.isinf(ref_lse))
        torch.testing.assert_close(lse[b:b + 1].nan_to_num(posinf=0), ref_lse.nan_to_num(posinf=0))
    assert torch.all(out[0] == 0) and torch.all(torch.isinf(lse[0]) & (lse[0] > 0))  # no key at all
    # cache_seqlens None is the whole cache; an int is every sequence's length
    full = attention_kvcache_reference(q, k_cache, v_cache, causal=causal, **options)
    as_int = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=24, causal=causal, **options)
    as_tensor = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=torch.full((4,), 24), causal=causal,
                                            **options)
    for a, b in zip(full, as_tensor):
        assert torch.equal(a, b)
    for a, b in zip(as_int, as_tensor):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seqlen_new", [0, 3])
@pytest.mark.parametrize("page_size", [4, 8])
def test_kvcache_reference_paged_equals_contiguous(seqlen_new, page_size):
    from cute_attn.reference import attention_kvcache_reference

    q, k_cache, v_cache, k, v = kv_case(seqlen_new=seqlen_new, seed=page_size)
    lengths = torch.tensor([0, 1, 24 - seqlen_new, 9], dtype=torch.int32)
    k_paged, v_paged, table = to_paged(k_cache, v_cache, page_size)
    saved = k_paged.clone(), v_paged.clone()
    slopes = torch.rand(4)
    dense = attention_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                        alibi_slopes=slopes)
    paged = attention_kvcache_reference(q, k_paged, v_paged, k, v, cache_seqlens=lengths, block_table=table,
                                        causal=True, alibi_slopes=slopes)
    assert torch.equal(saved[0], k_paged) and torch.equal(saved[1], v_paged)  # inputs untouched
    torch.testing.assert_close(paged[0], dense[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(paged[1]), torch.isinf(dense[1]))
    torch.testing.assert_close(paged[1].nan_to_num(posinf=0), dense[1].nan_to_num(posinf=0))
    assert torch.equal(from_paged(paged[2], table), dense[2]) and torch.equal(from_paged(paged[3], table), dense[3])
    unused = torch.ones(k_paged.shape[0], dtype=torch.bool)
    unused[table.long().flatten()] = False
    assert unused.sum() == 3
    assert torch.equal(paged[2][unused], k_paged[unused]) and torch.equal(paged[3][unused], v_paged[unused])


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
@pytest.mark.parametrize("rotary", [False, True])
def test_kvcache_reference_append(layout, rotary):
    """k/v land at exactly cache_seqlens[b] .. + seqlen_new of their cache row (k rotated at those
    positions), nothing else changes, and the same call attends to them."""
    from cute_attn.reference import apply_rotary_reference, attention_kvcache_reference

    batch, seqlen_new = 4, 3
    q, k_cache, v_cache, k, v = kv_case(seqlen_new=seqlen_new, seqlen_q=seqlen_new,
                                        batch_cache=8 if layout == "batch_idx" else None)
    lengths = torch.tensor([0, 1, 24 - seqlen_new, 9], dtype=torch.int32)
    rows = torch.tensor([5, 0, 7, 2], dtype=torch.int32) if layout == "batch_idx" else None
    cos = sin = None
    if rotary:
        angles = torch.rand(24, 4) * 2 * math.pi
        cos, sin = torch.cos(angles), torch.sin(angles)
    cache_k, cache_v, table = k_cache, v_cache, None
    if layout == "paged":
        cache_k, cache_v, table = to_paged(k_cache, v_cache, 8)
    out, lse, k_after, v_after = attention_kvcache_reference(
        q, cache_k, cache_v, k, v, cos, sin, cache_seqlens=lengths, cache_batch_idx=rows, block_table=table,
        causal=True, rotary_interleaved=False)
    if layout == "paged":
        k_after, v_after = from_paged(k_after, table), from_paged(v_after, table)
    positions = lengths.long()[:, None] + torch.arange(seqlen_new)
    k_rot = apply_rotary_reference(k, cos, sin, positions, False) if rotary else k
    q_rot = apply_rotary_reference(q, cos, sin, positions, False) if rotary else q  # causal: q token i at len + i
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        r = int(rows[b]) if rows is not None else b
        n = int(lengths[b])
        expected_k[r, n:n + seqlen_new] = k_rot[b]
        expected_v[r, n:n + seqlen_new] = v[b]
        keys = torch.cat((k_cache[r, :n], k_rot[b]))[None]
        values = torch.cat((v_cache[r, :n], v[b]))[None]
        ref, _ = attention_reference(q_rot[b:b + 1], keys, values, True)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(k_after, expected_k) and torch.equal(v_after, expected_v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", KV_OPTIONS[:3], ids=lambda o: "-".join(o) or "plain")
def test_kvcache_reference_leftpad_equals_slicing(causal, options):
    """Keys [leftpad, cache_seqlens + seqlen_new): distances (causal, window, ALiBi) count from the
    leftpad; rotary positions do not (they stay the cache's)."""
    from cute_attn.reference import apply_rotary_reference, attention_kvcache_reference

    q, k_cache, v_cache, k, v = kv_case(seqlen_new=2, seqlen_q=2, seed=5)
    lengths = torch.tensor([0, 5, 22, 9], dtype=torch.int32)
    leftpad = torch.tensor([0, 5, 4, 1], dtype=torch.int32)  # the second sees only its new keys
    angles = torch.rand(24, 8) * 2 * math.pi
    cos, sin = torch.cos(angles), torch.sin(angles)
    out, lse, k_after, v_after = attention_kvcache_reference(q, k_cache, v_cache, k, v, cos, sin,
                                                             cache_seqlens=lengths, cache_leftpad=leftpad,
                                                             causal=causal, **options)
    positions = lengths.long()[:, None] + torch.arange(2)
    q_positions = positions if causal or "window_size" in options else lengths.long()[:, None].expand(-1, 2)
    q_rot = apply_rotary_reference(q, cos, sin, q_positions, True)
    slopes = options.get("alibi_slopes")
    for b in range(4):
        n, p = int(lengths[b]), int(leftpad[b])
        opts = dict(options)
        if slopes is not None and slopes.dim() == 2:
            opts["alibi_slopes"] = slopes[b]
        keys, values = k_after[b:b + 1, p:n + 2], v_after[b:b + 1, p:n + 2]
        ref, ref_lse = attention_reference(q_rot[b:b + 1], keys, values, causal, **opts)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse[b:b + 1], ref_lse)
    # the rows before the leftpad are still written by nothing, and the appended ones are rotated
    assert torch.equal(k_after[1, :5], k_cache[1, :5])
    torch.testing.assert_close(k_after[2, 22:24], apply_rotary_reference(k, cos, sin, positions, True)[2])


def test_kvcache_reference_rotary_query_positions():
    """Rotary q: one position (cache_seqlens) for every query without causal or window; a window
    side at least the cache's capacity is no window (FlashAttention-2 drops it)."""
    from cute_attn.reference import apply_rotary_reference, attention_kvcache_reference

    q, k_cache, v_cache, k, v = kv_case(seqlen_new=3, seqlen_q=3, seed=9)
    lengths = torch.tensor([0, 4, 21, 9], dtype=torch.int32)
    angles = torch.rand(24, 8) * 2 * math.pi
    cos, sin = torch.cos(angles), torch.sin(angles)
    per_token = lengths.long()[:, None] + torch.arange(3)
    one = lengths.long()[:, None].expand(-1, 3)
    k_rot = apply_rotary_reference(k, cos, sin, per_token, True)
    for window, positions in [((-1, -1), one), ((30, -1), one), ((24, 24), one), ((23, -1), per_token),
                              ((-1, 0), per_token)]:
        out, _, k_after, v_after = attention_kvcache_reference(q, k_cache, v_cache, k, v, cos, sin,
                                                               cache_seqlens=lengths, window_size=window)
        q_rot = apply_rotary_reference(q, cos, sin, positions, True)
        for b in range(4):
            n = int(lengths[b])
            assert torch.equal(k_after[b, n:n + 3], k_rot[b])
            ref, _ = attention_reference(q_rot[b:b + 1], k_after[b:b + 1, :n + 3], v_after[b:b + 1, :n + 3],
                                         window_size=window)
            torch.testing.assert_close(out[b:b + 1], ref, atol=1e-6, rtol=1e-6)


def test_kvcache_reference_rejects_fa2_invalid_combinations():
    from cute_attn.reference import attention_kvcache_reference

    q, k_cache, v_cache, k, v = kv_case(seqlen_new=2)
    k_paged, v_paged, table = to_paged(k_cache, v_cache, 8)
    idx = torch.arange(4, dtype=torch.int32)
    cos = sin = torch.ones(24, 8)
    with pytest.raises(ValueError):
        attention_kvcache_reference(q, k_paged, v_paged, block_table=table, cache_batch_idx=idx)
    with pytest.raises(ValueError):
        attention_kvcache_reference(q, k_paged, v_paged, block_table=table, cache_leftpad=idx)
    with pytest.raises(ValueError):
        attention_kvcache_reference(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin, cache_seqlens=idx)
    with pytest.raises(ValueError):
        attention_kvcache_reference(q, k_cache, v_cache, k, v)  # appending needs cache_seqlens
    with pytest.raises(ValueError):
        attention_kvcache_reference(q, k_cache, v_cache, k, None, cache_seqlens=idx)


def test_varlen_reference_seqused_k_is_the_used_keys_alone():
    from cute_attn.reference import attention_varlen_reference

    torch.manual_seed(4)
    lens_q, lens_k, used = [5, 3, 4], [5, 6, 7], [2, 0, 7]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q, k, v = torch.randn(12, 2, 8), torch.randn(18, 2, 8), torch.randn(18, 2, 8)
    out, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, True, seqused_k=torch.tensor(used, dtype=torch.int32))
    keep = torch.cat([torch.arange(0, 2), torch.arange(11, 18)])
    cu_used = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    alone, alone_lse = attention_varlen_reference(q, k[keep], v[keep], cu_q, cu_used, True)
    torch.testing.assert_close(out, alone)
    torch.testing.assert_close(lse, alone_lse)
    assert torch.isinf(lse[:, 5:8]).all() and not out[5:8].any()  # no keys used: out 0, lse +inf
