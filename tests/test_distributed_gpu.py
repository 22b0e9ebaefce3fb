"""Ring attention on 2 GPUs over NCCL (marker ``gpu``; needs 2 GPUs): forward and backward against
single-GPU cute_attn on the gathered sequence, with the suite's error criterion."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _out_and_grads(attention, tensors, dout):
    """[out, dq, dk, dv] of ``attention`` on fresh leaves copied from ``tensors`` (q, k, v)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = attention(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    return [out, *torch.autograd.grad(out, leaves, dout)]


def _worker(rank, world, port, seqlen):
    import cute_attn
    from cute_attn import distributed as cp
    from cute_attn.reference import attention_reference
    from helpers import check_close

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    # (causal, window_size): plain, causal, and Mistral-style causal with a 1000-key left window
    # (narrower than a rank's slice: steps then attend only the pieces the window reaches)
    options = [(False, (-1, -1)), (True, (-1, -1)), (True, (1000, 0))]
    try:
        for head_dim in (64, 128):
            for causal, window in options:
                for layout in cp.LAYOUTS:
                    g = torch.Generator(device="cuda").manual_seed(head_dim + causal)  # same on every rank
                    q, k, v = (torch.randn(1, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                               for h in (8, 2, 2))
                    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
                    shards = [cp.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
                    out = cp.ring_flash_attn_func(*shards, causal=causal, window_size=window, layout=layout)
                    grads = torch.autograd.grad(out, shards, cp.shard_sequence(dout, layout=layout))
                    ring = [cp.gather_sequence(t, layout=layout) for t in (out, *grads)]

                    single = _out_and_grads(
                        lambda *t: cute_attn.flash_attn_func(*t, causal=causal, window_size=window), (q, k, v), dout)
                    ref = _out_and_grads(lambda *t: attention_reference(
                        *t, causal, compute_dtype=torch.float32, window_size=window), (q, k, v), dout)
                    case = f"d{head_dim} causal={causal} window={window} {layout} S={seqlen}"
                    for name, got, base, want in zip(("out", "dq", "dk", "dv"), ring, single, ref):
                        check_close(name, got, want, base, 1e-4, case)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seqlen", [4096, 8192])  # 2k and 4k tokens per rank
def test_ring_on_two_gpus_matches_one(seqlen):
    mp.spawn(_worker, args=(2, _free_port(), seqlen), nprocs=2, join=True)


def _sampled_reference(q, k, v, dout, rows, cols, chunk: int = 2048):
    """The fp32 causal reference of a long sequence, kept small: out and dq of the query ``rows``,
    dk and dv of the key ``cols`` (every query row contributes; the rows' softmax is computed in
    chunks of ``chunk`` queries, never the whole (S, S) score matrix). q (1, S, H, d), k/v (1, S,
    H_kv, d); returns (out[rows], dq[rows], dk[cols], dv[cols]) in fp32."""
    seqlen, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    group, scale = heads // k.shape[2], head_dim ** -0.5
    qf, dof = q[0].float().transpose(0, 1), dout[0].float().transpose(0, 1)  # (H, S, d)
    kf, vf = (t[0].float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out_rows, dq_rows = [], []
    dk_cols, dv_cols = torch.zeros(heads, len(cols), head_dim, device=q.device), None
    dv_cols = torch.zeros_like(dk_cols)
    keys = torch.arange(seqlen, device=q.device)
    for start in range(0, seqlen, chunk):
        i = torch.arange(start, min(start + chunk, seqlen), device=q.device)
        s = (qf[:, i] @ kf.transpose(1, 2)) * scale
        s.masked_fill_(keys[None, None, :] > i[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        out = p @ vf
        dp = dof[:, i] @ vf.transpose(1, 2)
        ds = p * (dp - (dof[:, i] * out).sum(-1, keepdim=True))
        del dp
        dk_cols += ds[:, :, cols].transpose(1, 2) @ qf[:, i] * scale
        dv_cols += p[:, :, cols].transpose(1, 2) @ dof[:, i]
        here = (rows >= start) & (rows < start + len(i))
        if here.any():
            r = rows[here] - start
            out_rows.append(out[:, r])
            dq_rows.append(ds[:, r] @ kf * scale)
    per_kv = lambda t: t.view(k.shape[2], group, len(cols), head_dim).sum(1).transpose(0, 1)  # noqa: E731
    return (torch.cat(out_rows, 1).transpose(0, 1), torch.cat(dq_rows, 1).transpose(0, 1),
            per_kv(dk_cols), per_kv(dv_cols))


def _long_worker(rank, world, port, seqlen):
    import cute_attn
    from cute_attn import distributed as cp
    from helpers import check_close

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        g = torch.Generator(device="cuda").manual_seed(11)  # same on every rank
        q, k, v = (torch.randn(1, seqlen, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
        dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        shards = [cp.shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = cp.ring_flash_attn_func(*shards, causal=True)
        grads = torch.autograd.grad(out, shards, cp.shard_sequence(dout))
        ring = [cp.gather_sequence(t) for t in (out, *grads)]
        single = _out_and_grads(lambda *t: cute_attn.flash_attn_func(*t, causal=True), (q, k, v), dout)
        if rank == 0:
            # rows and keys at both ends, at the rank/zigzag chunk edges and in between
            picks = torch.tensor([0, 1, 17, 1000, seqlen // 4 - 1, seqlen // 4, seqlen // 2 - 1, seqlen // 2,
                                  3 * seqlen // 4 + 5, seqlen - 2, seqlen - 1], device="cuda")
            picks = torch.cat([picks, torch.randint(0, seqlen, (53,), device="cuda", generator=g)]).unique()
            ref = _sampled_reference(q, k, v, dout, picks, picks)
            case = f"d128 causal zigzag S={seqlen} (sampled rows and keys)"
            for name, got, base, want in zip(("out", "dq", "dk", "dv"), ring, single, ref):
                check_close(name, got[0, picks], want, base[0, picks], 1e-4, case)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ring_64k_tokens_per_rank():
    """The issue's long end (64k tokens per rank, 131072 in all): the ring against single-GPU
    cute_attn and an fp32 reference on sampled query rows and keys."""
    mp.spawn(_long_worker, args=(2, _free_port(), 131072), nprocs=2, join=True)


def _varlen_worker(rank, world, port):
    import cute_attn
    from cute_attn import distributed as cp
    from cute_attn.reference import attention_varlen_reference
    from helpers import check_close

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        lengths = [4 * n for n in (300, 1, 0, 1024, 77)]  # multiples of 2 x world, an empty sequence
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        total, longest = int(cu[-1]), max(lengths)
        for causal in (False, True):
            for layout in cp.LAYOUTS:
                g = torch.Generator(device="cuda").manual_seed(7 + causal)
                q, k, v = (torch.randn(total, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                           for h in (8, 2, 2))
                dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
                shards = [cp.shard_varlen(t, cu, layout=layout)[0].requires_grad_() for t in (q, k, v)]
                local_cu = cu // world
                out = cp.ring_flash_attn_varlen_func(*shards, local_cu, longest // world, causal=causal, layout=layout)
                grads = torch.autograd.grad(out, shards, cp.shard_varlen(dout, cu, layout=layout)[0])
                ring = [cp.gather_varlen(t, cu, layout=layout) for t in (out, *grads)]

                single = _out_and_grads(
                    lambda *t: cute_attn.flash_attn_varlen_func(*t, cu, cu, longest, longest, causal=causal),
                    (q, k, v), dout)
                ref = _out_and_grads(
                    lambda *t: attention_varlen_reference(*t, cu, cu, causal, compute_dtype=torch.float32),
                    (q, k, v), dout)
                case = f"varlen causal={causal} {layout} lengths={lengths}"
                for name, got, base, want in zip(("out", "dq", "dk", "dv"), ring, single, ref):
                    check_close(name, got, want, base, 1e-4, case)
    finally:
        dist.destroy_process_group()


def test_varlen_ring_on_two_gpus_matches_one():
    mp.spawn(_varlen_worker, args=(2, _free_port()), nprocs=2, join=True)
