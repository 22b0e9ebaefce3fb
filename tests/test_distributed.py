"""Ring attention (cute_attn/distributed.py) on the CPU: 2 and 3 processes over gloo, the torch
reference in place of the kernels, against single-process attention, forward and backward."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cute_attn import distributed as cp
from cute_attn.reference import attention_block_backward_reference, attention_reference


def _reference_forward(q, k, v, causal, scale, softcap, window_size=(-1, -1)):
    return attention_reference(q, k, v, causal, scale, compute_dtype=torch.float64, softcap=softcap,
                               window_size=tuple(window_size))


def _reference_backward(dout, q, k, v, out, lse, causal, scale, deterministic, softcap, window_size=(-1, -1)):
    return attention_block_backward_reference(dout, q, k, v, out, lse, causal, scale, softcap, tuple(window_size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp._local_forward, cp._local_backward = _reference_forward, _reference_backward
    try:
        for layout, causal, heads, heads_kv, softcap, *window in cases:
            window_size = tuple(window[0]) if window else (-1, -1)
            torch.manual_seed(0)  # every rank builds the same full tensors
            seqlen = 12 * world
            q = torch.randn(2, seqlen, heads, 16, dtype=torch.float64, requires_grad=True)
            k = torch.randn(2, seqlen, heads_kv, 16, dtype=torch.float64, requires_grad=True)
            v = torch.randn(2, seqlen, heads_kv, 16, dtype=torch.float64, requires_grad=True)
            dout = torch.randn(2, seqlen, heads, 16, dtype=torch.float64)
            ref_out, ref_lse = attention_reference(q, k, v, causal, 0.3, compute_dtype=torch.float64, softcap=softcap,
                                                   window_size=window_size)
            ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)

            shards = [cp.shard_sequence(t.detach(), layout=layout).requires_grad_() for t in (q, k, v)]
            out, lse = cp.ring_flash_attn_func(*shards, causal=causal, softmax_scale=0.3, layout=layout,
                                               softcap=softcap, window_size=window_size, return_lse=True)
            grads = torch.autograd.grad(out, shards, cp.shard_sequence(dout, layout=layout))
            case = (f"world={world} {layout} causal={causal} heads={heads}/{heads_kv} softcap={softcap} "
                    f"window={window_size}")
            torch.testing.assert_close(cp.gather_sequence(out, layout=layout), ref_out, msg=case)
            torch.testing.assert_close(cp.gather_sequence(lse, layout=layout, dim=2), ref_lse, msg=case)
            for name, got, want in zip("qkv", grads, ref_grads):
                torch.testing.assert_close(cp.gather_sequence(got, layout=layout), want, msg=f"d{name} {case}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_single_process_attention(world):
    # softcap 1.0: far below these scores' range (|q k| * 0.3 reaches ~5), so the tanh is active
    cases = [(layout, causal, heads, heads_kv, 0.0) for layout in cp.LAYOUTS for causal in (False, True)
             for heads, heads_kv in ((2, 2), (4, 2))]
    cases += [(layout, causal, 4, 2, 1.0) for layout in cp.LAYOUTS for causal in (False, True)]
    mp.spawn(_worker, args=(world, _free_port(), cases), nprocs=world, join=True)


# windows narrower than a zigzag piece (6 rows at world 2), about one slice, wider than the
# sequence, one-sided either way, and causal with a left window (Mistral's); the sequence is 12 x world
RING_WINDOWS = [(False, (3, 2)), (True, (5, -1)), (False, (13, 0)), (False, (-1, 4)), (False, (0, 0)),
                (True, (40, 0)), (False, (7, 30))]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_with_sliding_window(world):
    """A window over the whole sequence: each step attends the piece pairs the window reaches,
    each as a local call with its own (never negative) window, and the result equals
    single-process windowed attention, forward and backward, both layouts."""
    cases = [(layout, causal, 4, 2, 0.0, window) for layout in cp.LAYOUTS for causal, window in RING_WINDOWS]
    cases += [("zigzag", True, 4, 2, 1.0, (5, 0))]
    mp.spawn(_worker, args=(world, _free_port(), cases), nprocs=world, join=True)


def test_band_windows_are_exact():
    """_band against every (query, key) pair: the sub-block holds exactly the visible pairs of the
    two pieces, its window is FlashAttention-valid (>= 0 or -1) and reproduces them."""
    from cute_attn.reference import visible_keys

    for left in (None, 0, 3, 17):
        for right in (None, 0, 2, 40):
            for q_start, q_len, k_start, k_len in [(0, 6, 0, 6), (6, 6, 0, 6), (0, 6, 30, 6), (18, 6, 6, 6),
                                                   (12, 12, 0, 12), (3, 5, 9, 7)]:
                want = {(i, j) for i in range(q_start, q_start + q_len) for j in range(k_start, k_start + k_len)
                        if (left is None or j >= i - left) and (right is None or j <= i + right)}
                band = cp._band(q_start, q_len, k_start, k_len, left, right)
                if band is None:
                    assert not want
                    continue
                (row, rows), (key, keys), window = band
                assert all(w >= -1 for w in window)
                seen = visible_keys(rows, keys, False, window)
                got = {(q_start + row + i, k_start + key + j) for i in range(rows) for j in range(keys) if seen[i, j]}
                assert got == want, (left, right, q_start, q_len, k_start, k_len, band)


def _varlen_reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, softcap):
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        if q1 > q0:
            o, l = _reference_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale, softcap)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _varlen_reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, deterministic,
                               softcap):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        if q1 > q0 and k1 > k0:
            grads = attention_block_backward_reference(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1],
                                                       v[None, k0:k1], out[None, q0:q1], lse[None, :, q0:q1],
                                                       causal, scale, softcap)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
    return dq, dk, dv


def _varlen_worker(rank, world, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp._local_varlen_forward, cp._local_varlen_backward = _varlen_reference_forward, _varlen_reference_backward
    try:
        for layout, causal, heads, heads_kv, softcap in cases:
            torch.manual_seed(0)
            lengths = [2 * world * n for n in (3, 0, 1, 5)]  # an empty sequence among them
            cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
            total = int(cu[-1])
            q = torch.randn(total, heads, 16, dtype=torch.float64, requires_grad=True)
            k = torch.randn(total, heads_kv, 16, dtype=torch.float64, requires_grad=True)
            v = torch.randn(total, heads_kv, 16, dtype=torch.float64, requires_grad=True)
            dout = torch.randn(total, heads, 16, dtype=torch.float64)
            ref_out, ref_lse = _varlen_reference_forward(q, k, v, cu, cu, None, None, causal, 0.3, softcap)
            ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)

            shards = [cp.shard_varlen(t.detach(), cu, layout=layout)[0].requires_grad_() for t in (q, k, v)]
            local_cu = cp.shard_varlen(q.detach(), cu, layout=layout)[1]
            max_local = max(lengths) // world
            out, lse = cp.ring_flash_attn_varlen_func(*shards, local_cu, max_local, causal=causal, softmax_scale=0.3,
                                                      layout=layout, softcap=softcap, return_lse=True)
            grads = torch.autograd.grad(out, shards, cp.shard_varlen(dout, cu, layout=layout)[0])
            case = f"varlen world={world} {layout} causal={causal} heads={heads}/{heads_kv} softcap={softcap}"
            torch.testing.assert_close(cp.gather_varlen(out, cu, layout=layout), ref_out, msg=case)
            torch.testing.assert_close(cp.gather_varlen(lse, cu, layout=layout, dim=1), ref_lse, msg=case)
            for name, got, want in zip("qkv", grads, ref_grads):
                torch.testing.assert_close(cp.gather_varlen(got, cu, layout=layout), want, msg=f"d{name} {case}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_varlen_ring_equals_single_process_attention(world):
    """Packed sequences, each split over the ranks (an empty one among them): the varlen ring
    equals attention per sequence, forward and backward, both layouts, causal and not, GQA, softcap."""
    cases = [(layout, causal, 4, 2, 0.0) for layout in cp.LAYOUTS for causal in (False, True)]
    cases += [("zigzag", True, 2, 2, 1.0)]
    mp.spawn(_varlen_worker, args=(world, _free_port(), cases), nprocs=world, join=True)


def test_layouts_round_trip_and_argument_checks():
    import tempfile

    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.arange(2 * 8).view(2, 8)
        for layout in cp.LAYOUTS:
            assert torch.equal(cp.gather_sequence(cp.shard_sequence(x, layout=layout), layout=layout), x)
        with pytest.raises(ValueError, match="multiple of 2"):
            cp.shard_sequence(torch.zeros(1, 7), layout="zigzag")
        with pytest.raises(ValueError, match="layout must be one of"):
            cp.shard_sequence(x, layout="striped")
        q = torch.zeros(1, 8, 2, 16)
        with pytest.raises(ValueError, match="window_size entries must be >= -1"):
            cp.ring_flash_attn_func(q, q, q, window_size=(4, -2))
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            cp.ring_flash_attn_func(q, q, q, window_size=4)
        with pytest.raises(ValueError, match="softcap must be a finite number"):
            cp.ring_flash_attn_func(q, q, q, softcap=-1.0)
        with pytest.raises(TypeError, match="causal must be a bool"):
            cp.ring_flash_attn_func(q, q, q, causal=1)
        with pytest.raises(ValueError, match="equal lengths"):
            cp.ring_flash_attn_func(q, q[:, :4], q[:, :4])
    finally:
        dist.destroy_process_group()
