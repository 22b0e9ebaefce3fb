"""Sliding windows, softcap, ALiBi and variable-length batches on the GPU (marker ``gpu``), forward
and backward, against the float32 reference (reference.py), on both kernel families (``arch``).

The feature sets are few on purpose (each is a kernel to compile): one feature at a time at d128,
and at every head dim two combinations: dense window + softcap + ALiBi, and varlen + causal +
softcap + ALiBi (``feature_keys`` lists them, for building ahead of time).
"""

import math

import pytest
import torch

import cute_attn
from cute_attn.reference import attention_reference
from helpers import alibi, check_close, check_dense, check_varlen, poisoned_like, random_qkv
from helpers import arch  # noqa: F401  (autouse: every test under both kernel families)

pytestmark = pytest.mark.gpu


SEQLENS = [(1, 1), (17, 113), (113, 17), (129, 255), (1000, 1000), (300, 1000)]
HEAD_DIMS = [32, 64, 96, 128, 192, 256, 72]


# one feature at a time (name, causal, options); softcap 2 is far below the scores' range here, so
# the tanh is strongly active; windows narrower than a tile and wider than several
SINGLE = [
    ("window", False, dict(window_size=(37, 11))),
    ("window_wide_left_causal", True, dict(window_size=(300, -1))),
    ("window_right_only", False, dict(window_size=(-1, 5))),
    ("window_left_only", False, dict(window_size=(130, -1))),
    ("softcap", True, dict(softcap=2.0)),
    ("alibi", False, dict(alibi=False)),
    ("alibi_per_batch_causal", True, dict(alibi=True)),
]


def _options(options, batch, heads):
    options = dict(options)
    if "alibi" in options:
        options["alibi_slopes"] = alibi(batch, heads, options.pop("alibi"))
    return options


@pytest.mark.parametrize("name,causal,options", SINGLE, ids=[c[0] for c in SINGLE])
def test_single_feature(name, causal, options):
    for seqlen_q, seqlen_k in SEQLENS:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, 6, 2, 128, torch.bfloat16)
        opts = _options(options, 2, 6)
        check_dense(q, k, v, causal, opts, f"{name} sq={seqlen_q} sk={seqlen_k}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_softcap_alibi_every_head_dim(head_dim):
    for seqlen_q, seqlen_k in [(17, 113), (129, 255), (1000, 1000)]:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 1, head_dim, torch.bfloat16)
        options = _options(dict(softcap=5.0, alibi=True, window_size=(60, 20)), 2, 4)
        check_dense(q, k, v, False, options, f"d={head_dim} sq={seqlen_q} sk={seqlen_k}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_every_head_dim(head_dim):
    """A window alone (no ALiBi, whose bias goes on every block): the SM90 backward masks only the
    Q blocks that cross its edges or the K/V block's end past seqlen_k, and skips the mask on the
    ones in between (``_unmasked_q_blocks``); windows wide enough to leave such blocks, K/V
    blocks that end past seqlen_k, seqlen_q != seqlen_k."""
    for seqlen_q, seqlen_k, window in [(1000, 1000, (300, 0)), (777, 1000, (200, 90)), (1000, 777, (129, 300))]:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16)
        check_dense(q, k, v, False, dict(window_size=window), f"d={head_dim} sq={seqlen_q} sk={seqlen_k} {window}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_window_over_many_kv_blocks(head_dim):
    """A causal window with more K/V blocks than SMs (the SM90 backward then runs its persistent
    grid, the forward its dynamic deal), GQA, softcap, seqlen_q != seqlen_k."""
    q, k, v = random_qkv(3, 1900, 2100, 8, 2, head_dim, torch.bfloat16)
    check_dense(q, k, v, True, dict(window_size=(256, 0), softcap=5.0), f"causal window d={head_dim}")


@pytest.mark.parametrize("head_dim,options", [(64, dict(softcap=5.0)), (128, dict(window_size=(300, 40), alibi=True))],
                         ids=["d64-softcap", "d128-window-alibi"])
def test_backward_fallback_candidates(head_dim, options):
    """Combinations whose SM90 backward table entry needs local memory run the next candidate
    (traits.sm90_backward_fallbacks: d64 one CTA per K/V block instead of the persistent grid,
    d128 64-row Q blocks instead of 80), with more K/V blocks than SMs, GQA and seqlen_q !=
    seqlen_k."""
    q, k, v = random_qkv(2, 1500, 1700, 8, 2, head_dim, torch.bfloat16)
    check_dense(q, k, v, False, _options(options, 2, 8), f"fallback d={head_dim} {sorted(options)}")


def test_all_features_fp16():
    q, k, v = random_qkv(2, 255, 300, 4, 2, 128, torch.float16)
    check_dense(q, k, v, False, _options(dict(softcap=5.0, alibi=False, window_size=(100, 0)), 2, 4), "fp16")


def test_deterministic_window_is_bitwise_repeatable():
    """A left window starts each Q block's K/V blocks past block 0 (block_info.dq_turn)."""
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16)
    options = dict(window_size=(200, 0), softcap=5.0)
    check_dense(q, k, v, False, options, "deterministic window", deterministic=True)
    out, lse = cute_attn.forward(q, k, v, return_lse=True, **options)
    torch.manual_seed(0)
    dout = torch.randn_like(out)
    first = cute_attn.backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for _ in range(3):
        again = cute_attn.backward(dout, q, k, v, out, lse, deterministic=True, **options)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------- varlen
LENGTHS_Q = [0, 1, 17, 127, 129, 1000, 300, 64]
LENGTHS_K = [5, 1, 113, 127, 0, 1000, 129, 64]  # per sequence seqlen_q != seqlen_k, a key-less one


def packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype):
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device="cuda").cumsum(0).to(torch.int32)
    q, _, _ = random_qkv(1, sum(lengths_q), 1, heads, heads_kv, head_dim, dtype)
    _, k, v = random_qkv(1, 1, sum(lengths_k), heads, heads_kv, head_dim, dtype)
    return q[0], k[0], v[0], cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen(causal, dtype):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 6, 2, 128, dtype)
    check_varlen(q, k, v, cu_q, cu_k, causal, {}, f"varlen causal={causal} {dtype}")


@pytest.mark.parametrize("num_seqs", [32, 70])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_many_sequences(causal, num_seqs):
    """A warp's worth of sequences and more (0 ... 300 tokens, seqlen_q != seqlen_k): the SM90
    forward numbers non-causal tiles without holes up to 32 sequences, a lane per sequence
    (tile_scheduler.varlen_tile_coords), and over the longest sequence beyond."""
    gen = torch.Generator().manual_seed(num_seqs)
    lengths_q = torch.randint(0, 300, (num_seqs,), generator=gen).tolist()
    lengths_k = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    lengths_q[:4], lengths_q[num_seqs // 2], lengths_q[-1] = [0, 1, 129, 0], 0, 0  # empty ones at either end and mid
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, causal, {}, f"{num_seqs} sequences causal={causal}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal,deterministic", [(True, False), (False, False), (True, True)])
def test_varlen_gqa_backward_head_splits(head_dim, causal, deterministic, monkeypatch):
    """Varlen GQA: the SM90 backward's query heads of a K/V head split over CTAs
    (interface.backward_head_splits; dK, dV in fp32, added into accumulators, or, deterministic,
    one tile per split summed by the host) and kept in one CTA give gradients within the same criterion,
    sequences of lengths 0 ... 1000 and seqlen_q != seqlen_k among them; with seqused_k, the rows
    of unused keys stay zero."""
    from cute_attn import interface

    for splits in ("group", 2, 1):
        forced = (lambda batch, heads, heads_kv, *rest, **kw: heads // heads_kv) if splits == "group" \
            else (lambda *args, splits=splits, **kw: splits)
        monkeypatch.setattr(interface, "backward_head_splits", forced)
        monkeypatch.setattr(interface, "_BACKWARD_LAUNCHES", {})
        q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 8, 2, head_dim, torch.bfloat16)
        case = f"varlen GQA d={head_dim} causal={causal} det={deterministic} splits={splits}"
        check_varlen(q, k, v, cu_q, cu_k, causal, {}, case, deterministic=deterministic)
        if splits == "group" and not deterministic:
            used = torch.tensor([3, 1, 100, 0, 0, 999, 64, 64], dtype=torch.int32, device="cuda")
            check_varlen(q, k, v, cu_q, cu_k, causal, {"seqused_k": used}, case + " seqused_k")


@pytest.mark.parametrize("causal", [False, True])
def test_dense_gqa_backward_head_splits(causal, monkeypatch):
    """Dense GQA with odd lengths (seqlen_q != seqlen_k, neither a multiple of the block): the
    split heads' fp32 dK/dV accumulation skips the rows past seqlen_k."""
    from cute_attn import interface

    monkeypatch.setattr(interface, "backward_head_splits",
                        lambda batch, heads, heads_kv, *rest, **kw: heads // heads_kv)
    monkeypatch.setattr(interface, "_BACKWARD_LAUNCHES", {})
    q, k, v = random_qkv(2, 129, 1000, 8, 2, 128, torch.bfloat16)
    check_dense(q, k, v, causal, {}, f"dense GQA split causal={causal}")


def test_varlen_noncausal_d64_backward():
    """d64 non-causal varlen (whose dense SM90 backward runs a persistent grid, varlen not): K/V
    blocks past a sequence's keys (the key-less one), dK = dV = 0 for those no query sees (the
    query-less one), more K/V blocks than SMs."""
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 4, 2, 64, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, False, {}, "varlen d64")
    lengths_q, lengths_k = [300, 0, 2000, 17, 1500], [1200, 700, 2100, 0, 1500]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 16, 16, 64, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, False, {}, "varlen d64, many K/V blocks")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_causal_more_tiles_than_sms(head_dim):
    """Causal varlen batches with many more tiles than SMs and lengths far apart: the SM90 forward's
    persistent CTAs then take tile after tile from its atomic counter (traits: dynamic tiles),
    skipping the numbers past a shorter sequence's end; a second call, whose counter starts at zero
    again, gives the same bits."""
    lengths = [1500, 17, 2900, 0, 640, 1, 2048, 129]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 8, 2, head_dim, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, True, {}, f"many tiles d={head_dim}")
    first = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, 2900, 2900, causal=True, return_lse=True)
    again = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, 2900, 2900, causal=True, return_lse=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_causal_softcap_alibi_every_head_dim(head_dim):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 4, 1, head_dim, torch.bfloat16)
    options = _options(dict(softcap=5.0, alibi=True), len(LENGTHS_Q), 4)
    check_varlen(q, k, v, cu_q, cu_k, True, options, f"d={head_dim}")


def test_varlen_window_softcap_alibi():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 6, 2, 128, torch.bfloat16)
    options = _options(dict(softcap=5.0, alibi=False, window_size=(60, 20)), len(LENGTHS_Q), 6)
    check_varlen(q, k, v, cu_q, cu_k, False, options, "varlen window")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_window(head_dim):
    """Windows alone over a varlen batch (the SM90 backward skips the mask on the Q blocks that see
    a whole K/V block: per sequence, from its own lengths)."""
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, torch.bfloat16)
    for window in [(200, 30), (300, 0)]:
        check_varlen(q, k, v, cu_q, cu_k, False, dict(window_size=window), f"varlen d={head_dim} {window}")


def test_varlen_deterministic_is_bitwise_repeatable():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 6, 2, 128, torch.bfloat16)
    options = dict(softcap=5.0, window_size=(60, 20), alibi_slopes=alibi(len(LENGTHS_Q), 6, True))
    check_varlen(q, k, v, cu_q, cu_k, False, options, "varlen deterministic", deterministic=True)
    max_q, max_k = max(LENGTHS_Q), max(LENGTHS_K)
    out, lse = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **options)
    dout = torch.randn_like(out)
    first = cute_attn.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, deterministic=True, **options)
    again = cute_attn.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, deterministic=True, **options)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


# FlashAttention-3's seqused_k: keys used per sequence, at most LENGTHS_K (0, all, some)
SEQUSED_K = [3, 0, 100, 127, 0, 517, 129, 1]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k(causal):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 6, 2, 128, torch.bfloat16)
    used = torch.tensor(SEQUSED_K, dtype=torch.int32, device="cuda")
    check_varlen(q, k, v, cu_q, cu_k, causal, {"seqused_k": used}, f"varlen seqused_k causal={causal}")


@pytest.mark.parametrize("head_dim", [64, 256])
def test_varlen_seqused_k_window_softcap_alibi(head_dim):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 4, 4, head_dim, torch.float16)
    options = _options(dict(softcap=5.0, alibi=True, window_size=(60, 20)), len(LENGTHS_Q), 4)
    options["seqused_k"] = torch.tensor(SEQUSED_K, dtype=torch.int32, device="cuda")
    check_varlen(q, k, v, cu_q, cu_k, False, options, f"varlen seqused_k window d={head_dim}", deterministic=True)


def test_flash_attn_varlen_func_seqused_k_equals_the_used_keys_alone():
    """seqused_k gives what the same call on only the used keys gives (and through autograd, zero
    gradients for the rest)."""
    q, k, v, cu_q, cu_k = packed([33, 200, 1], [40, 300, 7], 4, 2, 64, torch.bfloat16)
    used = torch.tensor([40, 123, 0], dtype=torch.int32, device="cuda")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, seqused_k=used)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    keep = torch.cat([torch.arange(0, 40), torch.arange(40, 163)]).cuda()
    cu_used = torch.tensor([0, 40, 163, 163], dtype=torch.int32, device="cuda")
    k2, v2 = (t.detach()[keep].requires_grad_(True) for t in (k, v))
    q2 = q.detach().clone().requires_grad_(True)
    out2 = cute_attn.flash_attn_varlen_func(q2, k2, v2, cu_q, cu_used, 200, 123, causal=True)
    dq2, dk2, dv2 = torch.autograd.grad(out2, (q2, k2, v2), dout)
    check_close("out", out.detach(), out2.detach(), out2.detach(), 1e-6, "seqused_k vs used keys")
    # the gradients within fp32 atomics' summation order
    torch.testing.assert_close(dq, dq2, atol=2e-2, rtol=0)
    for name, full, alone in (("dk", dk, dk2), ("dv", dv, dv2)):
        torch.testing.assert_close(full[keep], alone, atol=2e-2, rtol=0)
        rest = torch.ones(full.shape[0], dtype=torch.bool, device="cuda")
        rest[keep] = False
        assert not full[rest].any(), f"{name}: unused keys got gradients"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k_rows_past_the_used_keys_may_hold_nan(causal):
    """seqused_k's buffers filled to different depths (allocated with torch.empty, the rest never
    written): rows past each sequence's used keys hold NaN, which neither the forward nor the
    backward may read into a result (0 * NaN is NaN), as FlashAttention zero-fills them."""
    q, k, v, cu_q, cu_k = packed([3, 200, 1, 130], [50, 300, 64, 200], 4, 2, 128, torch.bfloat16)
    used = torch.tensor([17, 300, 0, 129], dtype=torch.int32, device="cuda")
    k_clean, v_clean = k.clone(), v.clone()
    for b, n in enumerate(used.tolist()):
        start, end = cu_k[b].item(), cu_k[b + 1].item()
        k[start + n:end], v[start + n:end] = float("nan"), float("nan")
    out, lse = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, 200, 300, causal=causal, seqused_k=used, return_lse=True)
    want, want_lse = cute_attn.varlen_forward(q, k_clean, v_clean, cu_q, cu_k, 200, 300, causal=causal,
                                              seqused_k=used, return_lse=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    dout = torch.randn_like(out)
    got = cute_attn.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 200, 300, causal=causal, seqused_k=used,
                                    deterministic=True)
    clean = cute_attn.varlen_backward(dout, q, k_clean, v_clean, want, want_lse, cu_q, cu_k, 200, 300, causal=causal,
                                      seqused_k=used, deterministic=True)
    for name, g, c in zip(("dq", "dk", "dv"), got, clean):
        torch.testing.assert_close(g, c, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    check_varlen(q, k_clean, v_clean, cu_q, cu_k, causal, dict(seqused_k=used), f"seqused causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_rows_past_the_last_sequence_may_hold_nan(causal):
    """q/k/v/dout buffers sized for more tokens than this batch holds (a serving step's or a
    padding-free loader's preallocated buffers, torch.empty): rows past cu_seqlens[-1] hold NaN.
    The last sequence's last blocks span them; outputs, LSE and gradients of the sequences equal
    those of buffers cut to the batch's tokens, bitwise (FlashAttention-2 never loads such rows).
    Likewise a sequence's blocks never read its neighbours' rows."""
    q, k, v, cu_q, cu_k = packed([3, 200, 1, 130], [50, 300, 64, 201], 4, 2, 128, torch.bfloat16)
    total_q, total_k = q.shape[0], k.shape[0]

    def nan_tail(t, rows=45):
        return torch.cat([t, torch.full((rows, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)])

    out, lse = cute_attn.varlen_forward(nan_tail(q), nan_tail(k), nan_tail(v), cu_q, cu_k, 200, 301, causal=causal,
                                        return_lse=True)
    want, want_lse = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, 200, 301, causal=causal, return_lse=True)
    torch.testing.assert_close(out[:total_q], want, atol=0, rtol=0)
    torch.testing.assert_close(lse[:, :total_q], want_lse, atol=0, rtol=0)
    dout = torch.randn_like(want)
    got = cute_attn.varlen_backward(nan_tail(dout), nan_tail(q), nan_tail(k), nan_tail(v), out, lse, cu_q, cu_k, 200,
                                    301, causal=causal, deterministic=True)
    clean = cute_attn.varlen_backward(dout, q, k, v, want, want_lse, cu_q, cu_k, 200, 301, causal=causal,
                                      deterministic=True)
    for name, g, c in zip(("dq", "dk", "dv"), got, clean):
        torch.testing.assert_close(g[:c.shape[0]], c, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    check_varlen(q, k, v, cu_q, cu_k, causal, {}, f"exact-size buffers causal={causal}")
    # a sequence of NaN (its own results NaN) leaves its neighbours' results as they were
    qn, kn, vn, doutn = q.clone(), k.clone(), v.clone(), dout.clone()
    for t, cu in ((qn, cu_q), (kn, cu_k), (vn, cu_k), (doutn, cu_q)):
        t[cu[1]:cu[2]] = float("nan")
    out_n, lse_n = cute_attn.varlen_forward(qn, kn, vn, cu_q, cu_k, 200, 301, causal=causal, return_lse=True)
    got = cute_attn.varlen_backward(doutn, qn, kn, vn, out_n, lse_n, cu_q, cu_k, 200, 301, causal=causal,
                                    deterministic=True)
    for name, g, c, cu in zip(("out", "dq", "dk", "dv"), (out_n, *got), (want, *clean), (cu_q, cu_q, cu_k, cu_k)):
        for part in ((0, cu[1]), (cu[2], cu[-1])):
            torch.testing.assert_close(g[part[0]:part[1]], c[part[0]:part[1]], atol=0, rtol=0,
                                       msg=lambda m, name=name: f"{name} beside a NaN sequence: {m}")


def test_flash_attn_varlen_func_autograd_and_fa2_positional_order():
    """FlashAttention-2's positional order (dropout_p, softmax_scale, causal); gradients through
    autograd equal the direct backward bitwise (deterministic), the autograd one run in autograd's
    own thread with the kernel family forced where the forward ran (the ``arch`` fixture's)."""
    q, k, v, cu_q, cu_k = packed([33, 200, 1], [40, 200, 7], 4, 2, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    scale = 0.2
    out, lse, probs = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 200, 0.0, scale, True,
                                                        deterministic=True, return_attn_probs=True)
    assert probs is None and lse.shape == (4, q.shape[0])
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = cute_attn.varlen_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k,
                                           200, 200, causal=True, softmax_scale=scale, deterministic=True)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
    dense = cute_attn.flash_attn_func(q[None, :33], k[None, :40], v[None, :40], 0.0, scale, True)
    check_close("out", out[None, :33].detach(), dense.detach(), dense.detach(), 1e-6, "varlen vs dense")
    assert math.isfinite(out.float().abs().sum().item())


# ---------------------------------------------------------------------------- packed q/k/v
PACKED_CASES = [  # (head dims, causal, dtype)
    ((64, 128, 256), True, torch.bfloat16),
    ((64, 128), False, torch.float16),
]


def _check_packed(case, out, q_in, packed_in, dim, unpacked):
    """Backward of a packed call's ``out``; the output and the gradients (q_in's, then the packed
    tensor's parts) equal bitwise what ``unpacked(views, dout)`` -> (out, (dq, dk, dv)) gives on
    the same views. Returns the views (q, k, v)."""
    dout = torch.randn_like(out)
    out.backward(dout)
    views = packed_in.detach().unbind(dim)
    views = views if q_in is None else (q_in.detach(), *views)
    want_out, want_grads = unpacked(views, dout)
    assert torch.equal(out.detach(), want_out), case
    got = (() if q_in is None else (q_in.grad,)) + packed_in.grad.unbind(dim)
    for g, want, name in zip(got, want_grads, ("dq", "dk", "dv")):
        assert torch.equal(g, want), f"{case}: {name}"
    return views


@pytest.mark.parametrize("head_dims,causal,dtype", PACKED_CASES, ids=["causal-bf16", "fp16"])
def test_fa2_packed_functions(head_dims, causal, dtype, monkeypatch):
    """flash_attn_qkvpacked_func, flash_attn_kvpacked_func (GQA, seqlen_q != seqlen_k) and their
    varlen forms (lengths 0, 1, 17, 127, 129, 1000): the output, and the gradients the backward
    writes into views of one packed buffer (poisoned before it runs), equal bitwise the unpacked
    deterministic calls on the same views writing separate buffers (which the tests above hold to
    the fp32 reference); the output is held to the reference here too."""
    from cute_attn import interface

    monkeypatch.setattr(interface, "_packed_gradient", lambda t: poisoned_like(t))

    def dense(views, dout):
        out, lse = cute_attn.forward(*views, causal=causal, return_lse=True)
        return out, cute_attn.backward(dout, *views, out, lse, causal=causal, deterministic=True)

    def check_out(out, views, case):
        ref, _ = attention_reference(*views, causal)
        same, _ = attention_reference(*views, causal, compute_dtype=dtype)
        check_close("out", out.detach(), ref, same, 1e-4, case)

    for d in head_dims:
        for seqlen_q, seqlen_k in [(1, 1), (17, 113), (129, 1000), (1000, 1000)]:
            case = f"d={d} sq={seqlen_q} sk={seqlen_k} causal={causal}"
            qkv = torch.stack(random_qkv(2, seqlen_q, seqlen_q, 4, 4, d, dtype), dim=2).requires_grad_()
            out = cute_attn.flash_attn_qkvpacked_func(qkv, 0.0, None, causal, deterministic=True)
            check_out(out, _check_packed(f"qkvpacked {case}", out, None, qkv, 2, dense), f"qkvpacked {case}")
            q, k, v = random_qkv(2, seqlen_q, seqlen_k, 6, 2, d, dtype)
            q, kv = q.requires_grad_(), torch.stack((k, v), dim=2).requires_grad_()
            out = cute_attn.flash_attn_kvpacked_func(q, kv, 0.0, None, causal, deterministic=True)
            check_out(out, _check_packed(f"kvpacked {case}", out, q, kv, 2, dense), f"kvpacked {case}")

        # varlen: empty, single-token and odd sequences in one batch
        lengths = [0, 1, 17, 127, 129, 1000]
        q, k, v, cu, _ = packed(lengths, lengths, 4, 4, d, dtype)
        qkv = torch.stack((q, k, v), dim=1).requires_grad_()
        out = cute_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 1000, 0.0, None, causal, deterministic=True)
        q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, 6, 2, d, dtype)
        q, kv = q.requires_grad_(), torch.stack((k, v), dim=1).requires_grad_()
        out_kv = cute_attn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 1000, 1000, 0.0, None, causal,
                                                           deterministic=True)
        for name, o, q_in, packed_in, cq, ck in [("varlen qkvpacked", out, None, qkv, cu, cu),
                                                 ("varlen kvpacked", out_kv, q, kv, cu_q, cu_k)]:
            def varlen(views, dout, cq=cq, ck=ck):
                out, lse = cute_attn.varlen_forward(*views, cq, ck, 1000, 1000, causal=causal, return_lse=True)
                return out, cute_attn.varlen_backward(dout, *views, out, lse, cq, ck, 1000, 1000, causal=causal,
                                                      deterministic=True)

            case = f"{name} d={d} causal={causal}"
            views = _check_packed(case, o, q_in, packed_in, 1, varlen)
            bounds = zip(cq.tolist(), cq.tolist()[1:], ck.tolist(), ck.tolist()[1:])
            for b, (q0, q1, k0, k1) in enumerate(bounds):
                seq = (views[0][None, q0:q1], views[1][None, k0:k1], views[2][None, k0:k1])
                check_out(o[None, q0:q1], seq, f"{case} seq {b}")


def feature_keys(smem_capacity: int = 227 * 1024) -> list:
    """The kernels this file compiles on an H100 with either kernel family (both run as target
    sm_90a there), SM90 forward length tiers included: for building the cache ahead of time."""
    from cute_attn.compile import backward_keys, backward_post_key, forward_key, forward_tier_siblings
    from cute_attn.kernels.features import Features
    from cute_attn.traits import sm90_tier_seqlen

    F = Features
    d128 = [(F(local=True), False), (F(softcap=True), True), (F(alibi=True), False), (F(alibi=True), True),
            (F(local=True, softcap=True), False), (F(local=True, softcap=True, alibi=True, varlen=True), False)]
    configs = [(f, c, 128, "bf16") for f, c in d128]
    configs += [(F(varlen=True), c, 128, dt) for c in (False, True) for dt in ("bf16", "fp16")]
    configs += [(F(local=True, softcap=True, alibi=True), False, 128, "fp16"), (F(varlen=True), True, 64, "bf16")]
    configs += [(F(softcap=True), False, 64, "bf16"), (F(local=True, alibi=True), False, 128, "bf16")]  # fallbacks
    for d in HEAD_DIMS:
        configs += [(F(local=True, softcap=True, alibi=True), False, d, "bf16"),
                    (F(softcap=True, alibi=True, varlen=True), True, d, "bf16"), (F(local=True), False, d, "bf16")]
    configs += [(F(local=True, varlen=True), False, d, "bf16") for d in (64, 128, 256)]
    # seqused_k: plain (bf16 d128, both causal), with window + softcap + ALiBi (fp16 d64/256,
    # deterministic), and the autograd case (bf16 d64 causal)
    configs += [(F(varlen=True, seqused=True), c, 128, "bf16") for c in (False, True)]
    seqused_all = [(F(local=True, softcap=True, alibi=True, varlen=True, seqused=True), False, d, "fp16")
                   for d in (64, 256)]
    configs += seqused_all + [(F(varlen=True, seqused=True), True, 64, "bf16")]
    deterministic = {(F(local=True, softcap=True), False, 128, "bf16"),
                     (F(local=True, softcap=True, alibi=True, varlen=True), False, 128, "bf16"), *seqused_all}
    # the packed functions (deterministic, dense and varlen)
    packed_configs = [(f, causal, d, "bf16" if causal else "fp16") for head_dims, causal, _ in PACKED_CASES
                      for d in head_dims for f in (F(), F(varlen=True))]
    configs += packed_configs
    deterministic |= set(packed_configs)
    keys: dict = {}
    for kernel in ("sm80", "sm90"):
        for features, causal, d, dtype in configs:
            seqlen = sm90_tier_seqlen(1000, 1000, causal)
            fwd = forward_key("sm_90a", dtype, d, causal, smem_capacity, kernel=kernel, seqlen=seqlen,
                              features=features)
            keys.update(dict.fromkeys(forward_tier_siblings(fwd)))
            for det in (False, True) if (features, causal, d, dtype) in deterministic else (False,):
                pre, main = backward_keys("sm_90a", dtype, d, causal, det, kernel=kernel, smem_capacity=smem_capacity,
                                          features=features)
                keys.update(dict.fromkeys([pre, main] + [backward_post_key(main, t) for t in main.candidates]))
    return list(keys)
