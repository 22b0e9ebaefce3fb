"""Context-parallel (ring) attention on several GPUs of one host: throughput of forward + backward
against one GPU running the whole sequence, and the peers that can run there (issue 16).

    python tools/bench_ring.py --world 2 --seqlen 131072 --head-dim 128 --heads 16 --causal
    python tools/bench_ring.py --model-only            # the scaling model alone (no GPU)

Every implementation runs on the same full tensors (built from one seed on every rank): cute_attn's
``ring_flash_attn_func`` on this rank's shards (``--layout``, zigzag by default), one GPU running
``flash_attn_func`` on the whole sequence (rank 0, while the others wait), and where importable
ring-flash-attention's ``zigzag_ring_flash_attn_func`` and torch's experimental ``context_parallel``
around SDPA. A timing is the wall time of ``--iters`` back-to-back forward + backward calls between
two barriers, the slowest rank's; FLOPs are the whole sequence's (causal halves them, the backward
counts 2.5x the forward), so a ring's TFLOP/s compare directly with one GPU's.

The scaling model (``ring_model``) prints what the ring should reach at more GPUs: per step every
rank computes 1/world^2 of the attention while the next K/V slice (and, in the backward, the fp32
dK/dV accumulators) crosses one link; the step takes the longer of the two when they overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

# (name, GB/s per direction) of the links the model prints: NVLink 4 (H100/H200 SXM) and one
# 400 Gb/s InfiniBand NDR port per GPU
LINKS = (("NVLink 4", 450.0), ("InfiniBand NDR", 50.0))


def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward + backward FLOPs of attention over the whole sequence (backward = 2.5x forward)."""
    forward = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return 3.5 * forward


def ring_model(seqlen: int, world: int, batch: int, heads: int, heads_kv: int, head_dim: int, causal: bool,
               tflops: float, link_gb_s: float, elem_bytes: int = 2) -> dict:
    """Predicted forward + backward of the ring on ``world`` GPUs, each computing at ``tflops``
    TFLOP/s with ``link_gb_s`` GB/s to its ring neighbour: per step, compute (1/world^2 of the
    work, balanced by the zigzag layout) against the bytes one step sends (forward: the K/V slice;
    backward: the K/V slice and the fp32 dK/dV accumulators). Returns the times per step and the
    parallel efficiency (one GPU's time / (world x the ring's time))."""
    flops = attention_flops(batch, seqlen, heads, head_dim, causal)
    steps = world
    compute_step = flops / world / world / (tflops * 1e12)
    kv_slice = 2 * batch * (seqlen // world) * heads_kv * head_dim * elem_bytes
    dkv_slice = 2 * batch * (seqlen // world) * heads_kv * head_dim * 4
    # the forward's steps are 1/3.5 of the compute; its sends are the K/V slice
    fwd_compute, bwd_compute = compute_step / 3.5, compute_step * 2.5 / 3.5
    fwd_comm = kv_slice / (link_gb_s * 1e9)
    bwd_comm = (kv_slice + dkv_slice) / (link_gb_s * 1e9)
    ring_time = steps * (max(fwd_compute, fwd_comm) + max(bwd_compute, bwd_comm)) if world > 1 else flops / (tflops * 1e12)
    single = flops / (tflops * 1e12)
    return {
        "world": world,
        "compute_per_step_ms": compute_step * 1e3,
        "comm_per_step_ms": (fwd_comm + bwd_comm) * 1e3,
        "ring_ms": ring_time * 1e3,
        "speedup": single / ring_time,
        "efficiency": single / ring_time / world,
    }


def model_lines(args, tflops: float) -> list[str]:
    lines = [f"scaling model: S {args.seqlen}, B {args.batch}, heads {args.heads}/{args.heads_kv}, d {args.head_dim}, "
             f"{'causal' if args.causal else 'full'}, {tflops:.0f} TFLOP/s per GPU",
             "", "| link | GPUs | compute / step (ms) | send / step (ms) | speedup | efficiency |", "|---|---|---|---|---|---|"]
    for name, gb_s in LINKS:
        for world in (2, 4, 8, 16, 32, 64):
            if args.seqlen % (2 * world):
                continue
            m = ring_model(args.seqlen, world, args.batch, args.heads, args.heads_kv, args.head_dim, args.causal,
                           tflops, gb_s)
            lines.append(f"| {name} ({gb_s:.0f} GB/s) | {world} | {m['compute_per_step_ms']:.2f} | "
                         f"{m['comm_per_step_ms']:.2f} | {m['speedup']:.2f}x | {m['efficiency']:.0%} |")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="GPUs (processes), one ring")
    p.add_argument("--seqlen", type=int, default=131072, help="the whole sequence's length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--iters", type=int, default=5, help="timed forward + backward calls")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--model-only", action="store_true", help="print the scaling model and exit (no GPU)")
    p.add_argument("--model-tflops", type=float, default=None,
                   help="TFLOP/s per GPU for the model (default: the measured one-GPU rate, else 500)")
    p.add_argument("--out", default="bench_results")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, iters: int, warmup: int) -> float:
    """Milliseconds per call: the slowest rank's wall time between two barriers."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - t0) * 1e3 / iters], device="cuda")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _implementations(args, rank, world, q, k, v, dout):
    """name -> a function running one forward + backward, on the full tensors or this rank's shards."""
    import torch

    from cute_attn import distributed as cp

    impls = {}
    shards = [cp.shard_sequence(t, layout=args.layout).requires_grad_() for t in (q, k, v)]
    dout_shard = cp.shard_sequence(dout, layout=args.layout)

    def ring():
        out = cp.ring_flash_attn_func(*shards, causal=args.causal, layout=args.layout)
        torch.autograd.grad(out, shards, dout_shard)

    impls[f"cute_attn ring ({args.layout}, {world} GPUs)"] = ring
    if not args.no_peers:
        try:  # zhuzilin's ring-flash-attention (needs flash-attn 2)
            from ring_flash_attn import zigzag_ring_flash_attn_func

            zz = [cp.shard_sequence(t, layout="zigzag").requires_grad_() for t in (q, k, v)]
            zz_dout = cp.shard_sequence(dout, layout="zigzag")

            def ring_flash_attn():
                out = zigzag_ring_flash_attn_func(*zz, causal=args.causal)
                torch.autograd.grad(out, zz, zz_dout)

            impls[f"ring-flash-attention zigzag ({world} GPUs)"] = ring_flash_attn
        except Exception as e:  # noqa: BLE001  (not installed, or its flash-attn 2 missing)
            if rank == 0:
                print(f"# ring-flash-attention not run: {type(e).__name__}: {e}", file=sys.stderr)
        try:  # torch's experimental context parallelism around SDPA (its own sharding of the buffers)
            import torch.nn.functional as F
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel

            mesh = init_device_mesh("cuda", (world,))

            def torch_cp():
                qt, kt, vt, dt = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, dout))
                with context_parallel(mesh, buffers=[qt, kt, vt, dt], buffer_seq_dims=[2, 2, 2, 2]):
                    # new leaves over the sharded buffers: on exit the context resizes the buffers
                    # back to the whole sequence, which a tensor that requires grad refuses
                    leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
                    out = F.scaled_dot_product_attention(*leaves, is_causal=args.causal,
                                                         enable_gqa=args.heads != args.heads_kv)
                    torch.autograd.grad(out, leaves, dt)

            impls[f"torch context_parallel + SDPA ({world} GPUs)"] = torch_cp
        except Exception as e:  # noqa: BLE001
            if rank == 0:
                print(f"# torch context_parallel not run: {type(e).__name__}: {e}", file=sys.stderr)
    return impls


def _worker(rank, world, port, args):
    import torch
    import torch.distributed as dist

    import cute_attn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    results = {}
    try:
        g = torch.Generator(device="cuda").manual_seed(0)  # the same full tensors on every rank
        shape = lambda h: (args.batch, args.seqlen, h, args.head_dim)  # noqa: E731
        q, k, v, dout = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, generator=g)
                         for h in (args.heads, args.heads_kv, args.heads_kv, args.heads))
        flops = attention_flops(args.batch, args.seqlen, args.heads, args.head_dim, args.causal)
        for name, fn in _implementations(args, rank, world, q, k, v, dout).items():
            try:
                results[name] = _timed(fn, args.iters, args.warmup)
            except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not fatal)
                results[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            torch.cuda.empty_cache()
        if not args.no_single:  # one GPU on the whole sequence, the others waiting
            name = "cute_attn, one GPU, whole sequence"
            try:
                if rank == 0:
                    full = [t.clone().requires_grad_() for t in (q, k, v)]

                    def single():
                        torch.autograd.grad(cute_attn.flash_attn_func(*full, causal=args.causal), full, dout)

                    for _ in range(args.warmup):
                        single()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        single()
                    torch.cuda.synchronize()
                    results[name] = (time.perf_counter() - t0) * 1e3 / args.iters
            except Exception as e:  # noqa: BLE001  (out of memory: the whole sequence does not fit)
                results[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            dist.barrier()
        if rank == 0:
            _report(args, world, flops, results)
    finally:
        dist.destroy_process_group()


def _report(args, world, flops, results):
    import torch

    single = results.get("cute_attn, one GPU, whole sequence")
    lines = [f"{torch.cuda.get_device_name()} x {world}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"torch {torch.__version__}; S {args.seqlen}, B {args.batch}, heads {args.heads}/{args.heads_kv}, "
             f"d {args.head_dim}, {'causal' if args.causal else 'full'}, bf16, forward + backward, "
             f"{args.iters} calls after {args.warmup}", "",
             "| implementation | ms per fwd+bwd | TFLOP/s (whole sequence) | / one GPU |", "|---|---|---|---|"]
    for name, ms in results.items():
        if isinstance(ms, str):
            lines.append(f"| {name} | {ms} | - | - |")
            continue
        ratio = f"{single / ms:.2f}x" if isinstance(single, float) else "-"
        lines.append(f"| {name} | {ms:.1f} | {flops / ms / 1e9:.0f} | {ratio} |")
    tflops = args.model_tflops or (flops / single / 1e9 if isinstance(single, float) else 500.0)
    lines += ["", *model_lines(args, tflops)]
    print("\n".join(lines), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_ring.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


def main(argv=None):
    args = _parser().parse_args(argv)
    args.heads_kv = args.heads_kv or args.heads
    if args.seqlen % (2 * args.world):
        raise SystemExit(f"--seqlen must be a multiple of 2 x --world ({2 * args.world}) for the zigzag layout")
    if args.model_only:
        print("\n".join(model_lines(args, args.model_tflops or 500.0)))
        return
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args.world, _free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
