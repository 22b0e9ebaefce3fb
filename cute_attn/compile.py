"""Compile keys, the compiled-kernel caches, and variant enumeration for the tools.

A compiled kernel depends only on its key (kernel family, GPU target, dtype, padded head dim,
causal, whether the head dim is padded, traits). Batch, sequence lengths, heads, strides and
pointers are run-time values, so a new shape never recompiles. The SM90 forward's length tiers
(traits.SM90_FORWARD) are separate keys, so the first use of one builds all tiers of its
configuration together (``forward_tier_siblings``): a later length never compiles.

Kernels are compiled from fake tensors (no GPU needed) with the TVM-FFI calling convention: the
compiled function takes torch tensors directly (zero-copy, via DLPack) and launches on torch's
current CUDA stream. Caches:
- in memory, per process, safe to use from several threads (one compile per key);
- on disk (``default_cache_dir``: ``$CUTE_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cute_attn`` or
  ``~/.cache/cute_attn``; ``CUTE_ATTN_CACHE_DIR=`` (empty) turns it off): exported objects, keyed by
  the key, the kernel sources and the DSL and TVM-FFI versions, loaded instead of recompiled.
  Entries are written atomically under a per-entry file lock (several processes filling one
  directory compile each kernel once); an entry that fails to load is rebuilt and replaced.
  Each entry is also linked into a shared library (where a C compiler is found), which TVM-FFI
  loads without importing the DSL: a process whose kernels all come from the cache never pays
  the DSL's import (most of a warm first call). The object file stays as the fallback. A kernel
  compiled into the disk cache is compiled for export only and loaded back from its entry, so
  the DSL builds no in-process JIT engine for it (``KernelCache._build_and_store``).

With the disk cache on, a first call compiles only the kernel it runs; the kernels built together
with it (the other length tiers, the split-KV kernel) and the backward of an autograd forward are
compiled meanwhile by a background process into the disk cache (``KernelCache.prefetch``), where
the first call that needs one loads it, or waits on its file lock while it is still compiling.
``CUTE_ATTN_BACKGROUND_BUILD=0`` builds them in the calling process instead, as does a cache
without a disk directory.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import gc
import hashlib
import os
import pickle
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.traits import (
    PAGE_BLOCK_MIN,
    SM90_BACKWARD,
    SM90_BACKWARD_LONG,
    SM90_BACKWARD_STREAM_K,
    SM90_CAUSAL_DYNAMIC_TILES,
    SM90_PAGE_ROWS,
    STREAM_K_ROW,
    BackwardTraits,
    ForwardTraits,
    Sm90BackwardTraits,
    Sm90ForwardTraits,
    padded_head_dim,
    pages_by_rows,
    sm80_backward_traits,
    sm80_decode_traits,
    sm80_forward_traits,
    sm90_backward_fallbacks,
    sm90_backward_traits,
    sm90_forward_traits,
    sm90_pages,
    sm90_seqlen_tier,
    sm90_seqlen_tiers,
)

DTYPES = ("bf16", "fp16")
# GPU targets the tools and tests compile for without a GPU
TARGETS = ("sm_80", "sm_90a")


@dataclass(frozen=True)
class ForwardKey:
    kernel: str  # kernel family: "sm80" | "sm90"
    target: str  # code-generation target: "sm_80", "sm_86", "sm_90a", ...
    dtype: str  # "bf16" | "fp16"
    head_dim: int  # padded head dim
    causal: bool
    check_hdim: bool  # actual head dim < padded head dim
    # candidate traits in order of preference: the first that compiles without local memory wins
    candidates: tuple[ForwardTraits, ...] = field(compare=True)
    features: Features = NO_FEATURES

    @property
    def name(self) -> str:
        return (
            f"fwd_{self.kernel}_{self.target}_{self.dtype}_d{self.head_dim}"
            f"{'_causal' if self.causal else ''}{self.features.suffix}{'_padded' if self.check_hdim else ''}"
            f"_{self.candidates[0].spec}{'+' if len(self.candidates) > 1 else ''}"
        )


def forward_key(target: str, dtype: str, head_dim: int, causal: bool, smem_capacity: int | None = None,
                traits=None, kernel: str = "sm80", seqlen: int = 0, features: Features = NO_FEATURES,
                page_size: int = 0) -> ForwardKey:
    """The forward variant for these parameters. ``kernel="sm90"`` (only for target sm_90a) falls
    back to the SM80 kernel where the SM90 table has no entry that fits ``smem_capacity``; explicit
    ``traits`` pick the family they belong to. ``seqlen`` (traits.sm90_tier_seqlen) picks the SM90
    table's tier (it runs other tiles and grids on short and long sequences); varlen passes
    max_seqlen_q. ``features``: the optional features compiled in (kernels/features.py); the
    decode features (KV cache, paged, split-KV, packed GQA) run the SM80-family kernel with the
    decode traits on every GPU, tile_n dividing ``page_size`` when paged, or a page per row
    (features.paged_rows) where the page size has no power-of-two factor of 64 keys. A varlen
    forward with ``paged`` and/or ``pack_gqa`` (no ALiBi) and no other decode feature, asked of
    ``kernel="sm90"``, runs the SM90 forward where it has an entry and takes the page size
    (traits.sm90_pages); one key serves every such page size."""
    tier = sm90_seqlen_tier(head_dim, causal, seqlen) if kernel == "sm90" and traits is None else 0
    sm90_has = (kernel == "sm90" and target == "sm_90a" and traits is None and features.varlen
                and not (features.kvcache or features.split or features.paged_rows)
                and (not features.paged or sm90_pages(page_size)) and not (features.pack_gqa and features.alibi)
                and bool(sm90_forward_traits(head_dim, causal, smem_capacity, tier)))
    if (features.decode or features.paged) and not sm90_has:
        if traits is None:
            traits = sm80_decode_traits(head_dim, smem_capacity, page_size)
        if features.paged and pages_by_rows(page_size):
            features = dataclasses.replace(features, paged_rows=True)
        return _forward_key(target, dtype, head_dim, causal, None, traits, "sm80", 0, features)
    # every sequence length of a tier maps to one cached key
    return _forward_key(target, dtype, head_dim, causal, smem_capacity, traits, kernel, tier, features)


@functools.lru_cache(maxsize=None)
def _forward_key(target: str, dtype: str, head_dim: int, causal: bool, smem_capacity: int | None,
                 traits, kernel: str, seqlen: int, features: Features = NO_FEATURES) -> ForwardKey:
    padded = padded_head_dim(head_dim)
    if isinstance(traits, tuple):  # SM80 candidates (the decode traits)
        kernel, candidates = "sm80", traits
    elif traits is not None:
        kernel, candidates = ("sm90" if isinstance(traits, Sm90ForwardTraits) else "sm80"), (traits,)
        if smem_capacity and traits.smem_bytes() > smem_capacity:
            raise ValueError(f"traits {traits.spec} need {traits.smem_bytes()} bytes of shared memory, "
                             f"the GPU has {smem_capacity}")
        if (causal or features.local or features.varlen) and getattr(traits, "kv_multicast", False):
            raise ValueError(f"traits {traits.spec}: K/V multicast needs the same K/V blocks for both Q "
                             f"blocks of a cluster, so causal, local and varlen attention cannot use it")
    elif kernel == "sm90" and target == "sm_90a" and sm90_forward_traits(head_dim, causal, smem_capacity, seqlen):
        candidates = _sm90_for_features(sm90_forward_traits(head_dim, causal, smem_capacity, seqlen), features, causal)
    else:
        kernel, candidates = "sm80", sm80_forward_traits(head_dim, causal, smem_capacity)
    if kernel == "sm90" and target != "sm_90a":
        raise ValueError(f"the SM90 forward kernel needs target sm_90a, got {target}")
    return ForwardKey(kernel, target, dtype, padded, bool(causal), head_dim != padded, candidates, features)


def _sm90_for_features(candidates, features: Features, causal: bool):
    """The SM90 table's traits adapted to the features: a local window or varlen gives the two Q
    blocks of a K/V multicast cluster different K/V blocks, so those variants run without
    multicast; a causal varlen batch or a windowed one of a head dim in
    traits.SM90_CAUSAL_DYNAMIC_TILES runs a persistent grid with dynamic tiles (the measured reason
    is there). (A window, causal or not, is a local kernel with ``causal`` False: its right edge is
    a run-time value.)"""
    if not (features.local or features.varlen):
        return candidates
    candidates = tuple(dataclasses.replace(t, kv_multicast=False) for t in candidates)
    if causal or features.local:
        candidates = tuple(dataclasses.replace(t, persistent=True, overlap_tiles=False, dynamic_tiles=True)
                           if t.head_dim in SM90_CAUSAL_DYNAMIC_TILES else t for t in candidates)
    return candidates


@dataclass(frozen=True)
class BackwardKey:
    """The main backward kernel. Its pre/postprocess kernels have ``RowKernelKey``s."""

    kernel: str  # kernel family: "sm80" | "sm90"
    target: str
    dtype: str
    head_dim: int
    causal: bool
    check_hdim: bool
    deterministic: bool
    # candidate traits in order of preference (see build_backward); the postprocess follows the
    # one taken (backward_post_key)
    candidates: tuple[BackwardTraits | Sm90BackwardTraits, ...]
    features: Features = NO_FEATURES

    @property
    def traits(self) -> BackwardTraits | Sm90BackwardTraits:
        return self.candidates[0]

    @property
    def name(self) -> str:
        t = self.traits
        return (
            f"bwd_{self.kernel}_{self.target}_{self.dtype}_d{self.head_dim}"
            f"{'_causal' if self.causal else ''}{self.features.suffix}{'_padded' if self.check_hdim else ''}"
            f"{'_det' if self.deterministic else ''}_{t.spec}{'+' if len(self.candidates) > 1 else ''}"
        )


@dataclass(frozen=True)
class RowKernelKey:
    """Backward preprocess ("bwd_pre") or postprocess ("bwd_post"). The postprocess reads the dQ
    accumulator in the main kernel's dQ MMA layout, so it carries the main kernel's traits."""

    kind: str
    target: str
    dtype: str
    head_dim: int
    check_hdim: bool
    traits: BackwardTraits | Sm90BackwardTraits | None = None
    varlen: bool = False  # the only feature the row kernels see
    # bwd_pre: zero the dQ accumulator (the SM80 backward adds every share; the SM90 one stores
    # the first share of each Q block, kernels/sm90/backward.py ``dq_first_share``)
    zero_dq_accum: bool = True

    @property
    def name(self) -> str:
        return (f"{self.kind}_{self.target}_{self.dtype}_d{self.head_dim}{'_padded' if self.check_hdim else ''}"
                f"{'_varlen' if self.varlen else ''}{'' if self.zero_dq_accum else '_unzeroed'}"
                f"{'_' + self.traits.spec if self.traits else ''}")


@functools.lru_cache(maxsize=None)
def backward_keys(target: str, dtype: str, head_dim: int, causal: bool, deterministic: bool,
                  traits: BackwardTraits | Sm90BackwardTraits | None = None, kernel: str = "sm80",
                  smem_capacity: int | None = None, features: Features = NO_FEATURES):
    """(preprocess, main) keys of one backward variant; see ``backward_post_key``. ``kernel="sm90"``
    (only for target sm_90a) falls back to the SM80 backward where the SM90 table has no entry
    that fits ``smem_capacity``; explicit ``traits`` pick the family they belong to."""
    padded = padded_head_dim(head_dim)
    check = head_dim != padded
    if traits is not None:
        kernel, candidates = ("sm90" if isinstance(traits, Sm90BackwardTraits) else "sm80"), (traits,)
        if kernel == "sm90" and not traits.swap_dkv and traits.tile_m % 64:
            # 80-row Q blocks: dQ^T with 64 head-dim columns per warpgroup, rows padded densely
            if padded != 128 or features.varlen:
                raise ValueError(f"traits {traits.spec}: Q blocks of {traits.tile_m} rows need head_dim 97-128 "
                                 f"and no varlen (got head_dim {head_dim}, varlen={features.varlen})")
    elif kernel == "sm90" and target == "sm_90a" and sm90_backward_traits(head_dim, causal, smem_capacity,
                                                                          features.varlen):
        candidates = sm90_backward_traits(head_dim, causal, smem_capacity, features.varlen)
    else:
        kernel, candidates = "sm80", sm80_backward_traits(head_dim)
    if kernel == "sm90" and target != "sm_90a":
        raise ValueError(f"the SM90 backward kernel needs target sm_90a, got {target}")
    if kernel == "sm90" and deterministic:
        # deterministic dQ takes turns in the one-CTA-per-K/V-block grid's launch order
        candidates = tuple(dict.fromkeys(dataclasses.replace(t, persistent=False) for t in candidates))
    main = BackwardKey(kernel, target, dtype, padded, bool(causal), check, bool(deterministic), candidates, features)
    pre = RowKernelKey("bwd_pre", target, dtype, padded, check, varlen=features.varlen,
                       zero_dq_accum=kernel != "sm90")
    return pre, main


def backward_long_key(main: BackwardKey) -> BackwardKey | None:
    """The long-sequence tier of ``main`` (traits.SM90_BACKWARD_LONG, from SM90_BACKWARD_LONG_SEQLEN
    query rows), or None where it has none: SM90, plain causal, not deterministic, the table's own
    traits (an explicit-traits key has no tier)."""
    long = SM90_BACKWARD_LONG.get(main.head_dim)
    if (long is None or main.kernel != "sm90" or not main.causal or main.deterministic
            or main.features != NO_FEATURES or main.candidates[0] != SM90_BACKWARD[main.head_dim][True]):
        return None
    return dataclasses.replace(main, candidates=(long, *sm90_backward_fallbacks(long)))


def backward_stream_k_key(main: BackwardKey) -> BackwardKey | None:
    """The Stream-K tier of ``main`` (traits.SM90_BACKWARD_STREAM_K, where traits.stream_k_blocks
    deals out blocks), or None where it has none: SM90, plain non-causal, not deterministic, the
    table's own traits (an explicit-traits key has no tier)."""
    tier = SM90_BACKWARD_STREAM_K.get(main.head_dim)
    if (tier is None or main.kernel != "sm90" or main.causal or main.deterministic
            or main.features != NO_FEATURES or main.candidates[0] != SM90_BACKWARD[main.head_dim][False]):
        return None
    return dataclasses.replace(main, candidates=(tier, *sm90_backward_fallbacks(tier)))


def backward_tier_siblings(key) -> list:
    """The backward kernels built together with ``key`` on its first use (compile.KernelCache's
    group): a main kernel with a tier (the causal long-sequence one, ``backward_long_key``, or
    the non-causal Stream-K one, ``backward_stream_k_key``) comes with that tier and its
    postprocess, and the tier with the main kernel, so that a later length never compiles.
    Other keys come alone."""
    if not isinstance(key, BackwardKey) or key.kernel != "sm90":
        return [key]
    for table, causal in ((SM90_BACKWARD_LONG, True), (SM90_BACKWARD_STREAM_K, False)):
        tier = table.get(key.head_dim)
        if tier is not None and key.candidates[0] == tier:  # a tier: the main kernel's, as backward_keys makes it
            main = dataclasses.replace(key, candidates=sm90_backward_traits(key.head_dim, causal))
            return [key, main, backward_post_key(main, main.candidates[0])]
    tier = backward_long_key(key) or backward_stream_k_key(key)
    return [key] if tier is None else [key, tier, backward_post_key(tier, tier.candidates[0])]


def backward_post_key(main: BackwardKey, chosen: BackwardTraits) -> RowKernelKey:
    """The postprocess for the traits the main kernel was compiled with (it reads the dQ
    accumulator in that kernel's dQ MMA layout, which neither Stream-K nor a persistent grid
    changes: one postprocess serves them all)."""
    if isinstance(chosen, Sm90BackwardTraits):
        chosen = dataclasses.replace(chosen, stream_k=False, persistent=False)
    return RowKernelKey("bwd_post", main.target, main.dtype, main.head_dim, main.check_hdim, chosen,
                        varlen=main.features.varlen)


def _cutlass_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[name]


def _fake_attention_tensors(dtype, kv_batch_own: bool = False):
    """Fake (batch, seqlen, heads, head_dim) tensors with symbolic shapes and strides: the last dim
    is contiguous and every other stride a multiple of 8 elements (16 bytes), as validated.
    ``kv_batch_own``: K/V's first mode is not q's batch (a KV cache's batch rows, or its pages)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    sym = cute.sym_int
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = (sym() for _ in range(6))
    kv_batch = sym() if kv_batch_own else batch

    def bshd(seqlen, nheads, b=batch):
        stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, (b, seqlen, nheads, head_dim), stride=stride, assumed_align=16)

    q, o = bshd(seqlen_q, heads), bshd(seqlen_q, heads)
    k, v = bshd(seqlen_k, heads_kv, kv_batch), bshd(seqlen_k, heads_kv, kv_batch)
    lse = make_fake_tensor(
        cutlass.Float32, (batch, heads, seqlen_q), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
    )
    return q, k, v, o, lse


def _fake_backward_tensors(dtype, head_dim_padded: int):
    """q, k, v, o, do, dq, dk, dv (batch, seqlen, heads, head_dim), lse (batch, heads, seqlen_q), the
    padded fp32 row buffers lse_log2 and D (batch, heads, seqlen_q_padded), the fp32 dQ accumulator
    (batch, heads, seqlen_q_padded, head_dim_padded) and the int32 semaphores."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    sym = cute.sym_int
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, seqlen_q_pad, m_blocks = (sym() for _ in range(8))
    heads_dkv = sym()  # the SM90 backward's dK, dV may hold a head per split of a K/V head's query heads

    def bshd(seqlen, nheads):
        stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        return make_fake_tensor(dtype, (batch, seqlen, nheads, head_dim), stride=stride, assumed_align=16)

    q, o, do, dq = (bshd(seqlen_q, heads) for _ in range(4))
    k, v = (bshd(seqlen_k, heads_kv) for _ in range(2))
    dk, dv = (bshd(seqlen_k, heads_dkv) for _ in range(2))
    f32 = cutlass.Float32
    lse = make_fake_tensor(f32, (batch, heads, seqlen_q), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    rows = [
        make_fake_tensor(f32, (batch, heads, seqlen_q_pad),
                         stride=(cute.sym_int64(divisibility=128), cute.sym_int64(divisibility=128), 1), assumed_align=16)
        for _ in range(2)
    ]
    dq_accum = make_fake_tensor(
        f32, (batch, heads, seqlen_q_pad, head_dim_padded),
        stride=(cute.sym_int64(divisibility=128), cute.sym_int64(divisibility=128), head_dim_padded, 1), assumed_align=16,
    )
    # the semaphores: one per Q block (the SM90 backward; the SM80 one's are a dummy (1, 1, 1) tensor
    # unless deterministic): shapes of their own
    sem = make_fake_tensor(cutlass.Int32, (sym(), sym(), m_blocks), stride=(cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=4)
    return dict(q=q, k=k, v=v, o=o, do=do, dq=dq, dk=dk, dv=dv, lse=lse, lse_log2=rows[0], d=rows[1],
                dq_accum=dq_accum, sem=sem)


def _fake_feature_args(features: Features) -> tuple:
    """The arguments every main kernel takes after its tensors and scales (before the stream):
    cu_seqlens_q, cu_seqlens_k (int32 (batch + 1,), varlen only), the keys used per sequence
    (int32 (batch,): varlen's seqused_k, a KV cache's cache_seqlens), the ALiBi slopes (fp32 (batch,
    heads) with any batch stride, ALiBi only), the longest sequence of the grid's direction
    (max_seqlen_q forward, max_seqlen_k backward: the grid of a varlen batch), the window edges
    and softmax_scale / softcap. Disabled features get None: compiled out, passed as None."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    assert not features.seqused or features.varlen, "seqused_k is a varlen option"
    cu_q = cu_k = seqused = slopes = None
    if features.varlen:
        batch_plus_1 = cute.sym_int()
        cu_q, cu_k = (make_fake_tensor(cutlass.Int32, (batch_plus_1,), stride=(1,), assumed_align=4) for _ in range(2))
    if features.seqused_k:
        seqused = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    if features.alibi:
        slopes = make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                                  assumed_align=4)
    return (cu_q, cu_k, seqused, slopes, cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(1.0))


def _fake_decode_args(features: Features) -> tuple:
    """What the SM80 forward takes after ``_fake_feature_args`` (before the stream): the KV cache's
    cache_leftpad, cache_batch_idx ((batch,) int32, kvcache only; its cache_seqlens are the feature
    args' keys used per sequence), the block table
    ((batch, max_pages) int32, paged only), the split-KV accumulators (O (splits, batch, seqlen_q,
    heads, d) and LSE (splits, batch, heads, seqlen_q) fp32, contiguous; split only), num_splits,
    the per-tile split counters ((tiles,) int32; split only) and merge_in_cta."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    sym, sym64 = cute.sym_int, cute.sym_int64
    per_seq = (None, None)
    if features.kvcache:
        batch = sym()
        per_seq = tuple(make_fake_tensor(cutlass.Int32, (batch,), stride=(1,), assumed_align=4) for _ in range(2))
    table = _fake_page_table(features)
    o_accum = lse_accum = counter = None
    if features.split:
        splits, batch, seqlen_q, heads, head_dim = (sym() for _ in range(5))
        # (strides of whole 16-byte chunks: the in-CTA merge reads the partials 128 bits at a time)
        o_accum = make_fake_tensor(cutlass.Float32, (splits, batch, seqlen_q, heads, head_dim),
                                   stride=tuple(sym64(divisibility=4) for _ in range(4)) + (1,), assumed_align=16)
        lse_accum = make_fake_tensor(cutlass.Float32, (splits, batch, heads, seqlen_q),
                                     stride=(sym64(), sym64(), sym64(), 1), assumed_align=4)
        counter = make_fake_tensor(cutlass.Int32, (sym(),), stride=(1,), assumed_align=4)
    return (*per_seq, table, o_accum, lse_accum, cutlass.Int32(1), counter, cutlass.Int32(0))


def _fake_page_table(features: Features):
    """The block table ((batch, max_pages) int32, last dim contiguous) of a paged kernel, else None."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if not features.paged:
        return None
    return make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                            assumed_align=4)


def _fake_row_kernel_args(varlen: bool) -> tuple:
    """cu_seqlens_q (varlen) and max_seqlen_q: what the backward's pre/postprocess take before the stream."""
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    import cutlass.cute as cute

    cu_q = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4) if varlen else None
    return (cu_q, cutlass.Int32(1))


def sm90_split_dkv_fp32(traits: Sm90BackwardTraits) -> bool:
    """Whether an SM90 backward variant writes the dK, dV of split query heads in fp32
    (``mdKV_split``: added into shared accumulators, or, deterministic, one tile per split),
    rounded once on the host. Not the large head dims' kernel (dK^T, dV^T accumulators,
    backward_large.py) nor the persistent grids (d32/d64 non-causal, which never split by the
    rule: with the fp32 path compiled in, the d64 one spilled and fell back to one CTA per K/V
    block, 4-7% slower): those write split heads per split in the input dtype. A persistent
    Stream-K grid (never split: Stream-K runs with one split) takes the fp32 placeholder as the
    one-CTA-per-block kernel it is a tier of does."""
    return not traits.swap_dkv and (not traits.persistent or traits.stream_k)


def _fake_sm90_backward_args(key: "BackwardKey", traits: Sm90BackwardTraits) -> tuple:
    """What the SM90 backward takes after the feature arguments (before the stream): the number
    of SMs (a persistent grid's size), the query-head splits of a K/V head (GQA), the sequences'
    order (varlen, not causal: longest first, interface._longest_first), the fp32 dK/dV of split
    heads (2, batch, seqlen_k, heads, head_dim_padded) where ``sm90_split_dkv_fp32``, and
    Stream-K's blocks, workspace (num_sms, 2, tile_n * head_dim_padded) fp32, flags (num_sms,) and
    items (num_sms, STREAM_K_ROW) int32 where ``traits.stream_k``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    order = split = None
    if key.features.varlen and not key.causal:
        order = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    if sm90_split_dkv_fp32(traits):
        sym, sym64 = cute.sym_int, cute.sym_int64
        split = make_fake_tensor(cutlass.Float32, (2, sym(), sym(), sym(), key.head_dim),
                                 stride=(sym64(divisibility=4), sym64(divisibility=4), sym64(divisibility=4),
                                         key.head_dim, 1), assumed_align=16)
    work = flags = items = None
    if traits.stream_k:
        tile = traits.tile_n * key.head_dim
        work = make_fake_tensor(cutlass.Float32, (cute.sym_int(), 2, tile), stride=(2 * tile, tile, 1),
                                assumed_align=16)
        flags = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        items = make_fake_tensor(cutlass.Int32, (cute.sym_int(), STREAM_K_ROW), stride=(STREAM_K_ROW, 1),
                                 assumed_align=4)
    return (cutlass.Int32(132), cutlass.Int32(1), order, split, cutlass.Int32(0), work, flags, items)


def build_backward(key, keep_artifacts: bool = False):
    """Compile the backward preprocess, main or postprocess kernel for ``key`` (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute

    from cute_attn.kernels.sm80 import backward as bwd
    from cute_attn.kernels.sm90 import backward as bwd90

    dtype = _cutlass_dtype(key.dtype)
    t = _fake_backward_tensors(dtype, key.head_dim)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if isinstance(key, RowKernelKey) and key.kind == "bwd_pre":
        kernel = bwd.BackwardPreprocessSm80(dtype, key.head_dim, key.check_hdim, varlen=key.varlen,
                                            zero_dq_accum=key.zero_dq_accum)
        args = (t["o"], t["do"], t["lse"], t["lse_log2"], t["d"], t["dq_accum"], *_fake_row_kernel_args(key.varlen))
    elif isinstance(key, RowKernelKey) and key.kind == "bwd_post":
        tr = key.traits
        if isinstance(tr, Sm90BackwardTraits):  # the accumulator is in the SM90 kernel's slot order
            kernel = bwd90.BackwardPostprocessSm90(dtype, key.head_dim, key.check_hdim, tr.tile_m, varlen=key.varlen)
            args = (t["dq_accum"], t["dq"], t["sem"], cutlass.Float32(1.0), *_fake_row_kernel_args(key.varlen))
        else:
            kernel = bwd.BackwardPostprocessSm80(dtype, key.head_dim, key.check_hdim, tr.tile_m, tr.num_warps,
                                                 tr.dq_warps_m, varlen=key.varlen)
            args = (t["dq_accum"], t["dq"], cutlass.Float32(1.0), *_fake_row_kernel_args(key.varlen))
    elif isinstance(key, BackwardKey):
        args = (t["q"], t["k"], t["v"], t["do"], t["lse_log2"], t["d"], t["dq_accum"], t["dk"], t["dv"], t["sem"],
                cutlass.Float32(1.0), cutlass.Float32(1.0), *_fake_feature_args(key.features))

        def compile_one(tr, keep):
            sm90 = _fake_sm90_backward_args(key, tr) if key.kernel == "sm90" else ()
            if key.kernel == "sm90" and tr.swap_dkv:
                from cute_attn.kernels.sm90 import backward_large

                kernel = backward_large.FlashAttentionBackwardSm90LargeHeadDim(
                    dtype, key.head_dim, tr.tile_m, tr.tile_n, tr.num_stages, tr.dout_stages, key.causal,
                    key.deterministic, features=key.features, dq_parts=tr.dq_parts,
                )
            elif key.kernel == "sm90":
                kernel = bwd90.FlashAttentionBackwardSm90(
                    dtype, key.head_dim, tr.tile_m, tr.tile_n, tr.num_stages, key.causal, key.deterministic,
                    features=key.features, longest_first=tr.longest_first,
                    persistent=tr.persistent, stream_k=tr.stream_k,
                )
            else:
                kernel = bwd.FlashAttentionBackwardSm80(
                    dtype, key.head_dim, tr.tile_m, tr.tile_n, tr.num_warps, tr.sdp_warps_m, tr.dkv_warps_n,
                    tr.dq_warps_m, key.causal, key.check_hdim, key.deterministic, features=key.features,
                )
            return _compile(kernel, *args, *sm90, stream, target=key.target, keep_artifacts=keep)

        return _first_without_local_memory(key.candidates, compile_one, keep_artifacts)
    else:
        raise ValueError(f"not a backward key: {key!r}")
    return _compile(kernel, *args, stream, target=key.target, keep_artifacts=keep_artifacts)


class _GcPause:
    """Python's cyclic garbage collector off while a kernel compiles (re-entrant, any thread).

    Importing the DSL and tracing a kernel allocate hundreds of thousands of short-lived objects;
    with torch loaded, a full collection among them walks torch's millions of live objects too
    (CPU machine: 0.11-0.12 s, and 0.04 s of young collections, per cold compile). Paused, the
    cold first call on H100 went from 2.83 to 2.67 s (medians, docs/performance.md). Reference
    counting still frees what the compile drops; cycles wait for the next collection after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                # what the compile left alive joins the oldest generation unscanned (freeze then
                # unfreeze moves every object there); left young, the first collection after the
                # pause would walk all of it (~0.05 s). Not where the program froze objects itself
                # (gc.freeze before forking workers): unfreezing would hand those back to the collector
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()


_GC_PAUSED = _GcPause()


# False while a KernelCache with a disk directory builds a key: the kernel is then only exported
# (and loaded back from the cache entry), so the compile skips the DSL's in-process JIT engine
_JIT_ENGINE = contextvars.ContextVar("cute_attn_jit_engine", default=True)


def _compile(kernel, *args, target: str, keep_artifacts: bool, ptxas_options: str = ""):
    """cute.compile for ``target``; with ``keep_artifacts`` the PTX and cubin stay on the result
    (``__ptx__``, ``__cubin__``), written through a private temporary dump dir. Under
    ``_JIT_ENGINE`` False the result can be exported but not called."""
    import tempfile

    import cutlass.cute as cute

    options = f"--enable-tvm-ffi --gpu-arch {target}"
    if ptxas_options:
        options += f" --ptxas-options '{ptxas_options}'"
    engine = {} if _JIT_ENGINE.get() else {"no_jit_engine": True}
    if not keep_artifacts:
        return cute.compile(kernel, *args, options=options, **engine)
    with tempfile.TemporaryDirectory(prefix="cute_attn_") as tmp:
        return cute.compile(kernel, *args, options=f"{options} --keep-ptx --keep-cubin --dump-dir {tmp}", **engine)


def _first_without_local_memory(candidates, compile_one: Callable, keep_artifacts: bool):
    """Compile the candidates in order and return the first whose cubin needs no local memory (the
    last one regardless); ``.traits`` on the result tells which candidate was taken."""
    from cute_attn.artifacts import cubin_resources

    for i, traits in enumerate(candidates):
        last = i == len(candidates) - 1
        fn = compile_one(traits, keep_artifacts or not last)
        if last or cubin_resources(fn.__cubin__)["stack_frame"] == 0:
            fn.traits = traits
            return fn


def build_forward(key: ForwardKey, keep_artifacts: bool = False):
    """Compile one forward variant (no GPU needed): the first candidate traits that compiles
    without local memory. ``keep_artifacts`` keeps PTX and cubin on the returned object
    (``__ptx__``, ``__cubin__``)."""
    return _first_without_local_memory(
        key.candidates, lambda traits, keep: _build_forward_traits(key, traits, keep), keep_artifacts
    )


def _build_forward_traits(key: ForwardKey, t, keep_artifacts: bool):
    import cutlass
    import cutlass.cute as cute

    dtype = _cutlass_dtype(key.dtype)
    if key.kernel == "sm80":
        from cute_attn.kernels.sm80.forward import FlashAttentionForwardSm80

        kernel = FlashAttentionForwardSm80(
            dtype, key.head_dim, t.tile_m, t.tile_n, t.num_warps, t.num_stages, key.causal, key.check_hdim, t.pv_chunks,
            features=key.features,
        )
        ptxas = "" if t.reg_level is None else f"--register-usage-level={t.reg_level}"
    elif key.kernel == "sm90":
        from cute_attn.kernels.sm90.forward import FlashAttentionForwardSm90

        kernel = FlashAttentionForwardSm90(
            dtype, key.head_dim, t.tile_m, t.tile_n, t.num_stages, key.causal, key.check_hdim,
            intra_wg_overlap=t.intra_wg_overlap, pingpong=t.pingpong, persistent=t.persistent,
            overlap_tiles=t.overlap_tiles, kv_multicast=t.kv_multicast, features=key.features,
            dynamic_tiles=t.dynamic_tiles, mask_every_block=t.mask_every_block,
        )
        ptxas = ""
    else:
        raise ValueError(f"unknown forward kernel family {key.kernel!r}")
    q, k, v, o, lse = _fake_attention_tensors(dtype, kv_batch_own=key.features.kvcache or key.features.paged)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # the SM90 kernel also takes the number of SMs (the size of a persistent grid), the causal
    # tile order's heads per section and (dynamic tiles) the tile counter
    extra = ()
    if key.kernel == "sm90":
        from cutlass.cute.runtime import make_fake_tensor

        counter = make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4) if t.dynamic_tiles else None
        extra = (cutlass.Int32(132), cutlass.Int32(1), counter)
    # the SM80 kernel's KV cache and split-KV arguments; the SM90 kernel's block table
    decode = _fake_decode_args(key.features) if key.kernel == "sm80" else (_fake_page_table(key.features),)
    return _compile(kernel, q, k, v, o, lse, cutlass.Float32(1.0), *extra, *_fake_feature_args(key.features),
                    *decode, stream, target=key.target, keep_artifacts=keep_artifacts, ptxas_options=ptxas)


def default_cache_dir() -> str | None:
    """The disk cache directory: ``$CUTE_ATTN_CACHE_DIR`` when set (empty: no disk cache), else
    ``$XDG_CACHE_HOME/cute_attn``, else ``~/.cache/cute_attn``."""
    env = os.environ.get("CUTE_ATTN_CACHE_DIR")
    if env is not None:
        return env or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cute_attn")


class KernelCache:
    """Compiled kernels by key: in memory, optionally backed by a directory of exported objects.

    Thread-safe: concurrent first calls for one key compile it once; other keys proceed in parallel.
    Process-safe on disk: a per-entry lock file makes concurrent processes compile a key once (the
    others then load it), and entries are renamed into place complete.
    For keys with several candidate traits, ``chosen(key)`` tells which one was compiled (kept in a
    small file next to the exported object, so it survives the disk cache). ``group(key)`` lists
    keys to build together with ``key`` on its first use. ``builds`` / ``loads`` count compiles and
    disk loads (for tests and tools).
    """

    EXPORT_NAME = "kernel"

    def __init__(self, build: Callable[[Any], Any], disk_dir: str | None = None,
                 group: Callable[[Any], Iterable[Any]] | None = None, background: bool = False,
                 bootstrap: Callable[[Any], Any] | None = None):
        self._build = build
        self._group = group
        self._background = background
        self._bootstrap = bootstrap
        self._slots: dict[Any, KernelSlot] = {}
        self._fns: dict[Any, Any] = {}
        self._chosen: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}
        self._disk = Path(disk_dir) if disk_dir else None
        self.builds = 0
        self.loads = 0

    def get(self, key):
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        fn = self._get_one(key)
        others = [other for other in (self._group(key) if self._group else ()) if other != key]
        if others:
            self.prefetch(others)
        return fn

    def slot(self, key) -> "KernelSlot":
        """A callable that runs ``key``'s kernel. Where ``bootstrap(key)`` names a kernel that
        computes the same results but compiles faster, and ``key`` is neither in memory nor on
        disk and builds in the background (a cold start), the slot runs the bootstrap kernel,
        compiled here, while one background process compiles ``key``, then its group, into the
        disk cache; the first call after that ends loads ``key`` and runs it from then on."""
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        boot = self._bootstrap(key) if self._bootstrap is not None else None
        if boot is not None and key not in self._fns and self._builds_in_background() and self._not_on_disk([key]):
            # one child builds the key, then its group (the bootstrap's own group is not built)
            done = threading.Event()
            group = [other for other in (self._group(key) if self._group else ()) if other != key]
            _BACKGROUND.submit(str(self._disk), [key, *self._not_on_disk(group)], done=done, first=True)
            fn = self._get_one(boot)
            slot = KernelSlot(self, key, fn, self._chosen.get(boot), done)
        else:
            slot = KernelSlot(self, key, self.get(key), self.chosen(key))
        return self._slots.setdefault(key, slot)

    def _builds_in_background(self) -> bool:
        return (self._background and self._disk is not None
                and os.environ.get("CUTE_ATTN_BACKGROUND_BUILD", "1") != "0")

    def _not_on_disk(self, keys) -> list:
        """The keys whose disk entry is not there, nor being written (its choice file comes first)."""
        return [key for key in keys if not self._path(key).with_suffix(".choice").exists()]

    def prefetch(self, keys, now_otherwise: bool = True) -> None:
        """Make ``keys`` ready for a later ``get`` without compiling them here when this cache has
        a disk directory and background builds are on: a background process compiles the ones
        not yet on disk (``_BackgroundBuilds``). Otherwise they are built (or loaded) now, or,
        with ``now_otherwise=False`` (keys that may never be asked for), left alone."""
        keys = [key for key in keys if key not in self._fns]
        if not keys:
            return
        if self._builds_in_background():
            missing = self._not_on_disk(keys)
            if missing:
                _BACKGROUND.submit(str(self._disk), missing)
            return
        for key in keys if now_otherwise else ():
            self._get_one(key)

    def _get_one(self, key):
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            fn = self._fns.get(key)
            if fn is None:
                with self._disk_lock(key):
                    fn = self._load(key)
                    if fn is None:
                        fn = self._build_and_store(key)
                    else:
                        self.loads += 1
                self._fns[key] = fn
        return fn

    def _build_and_store(self, key):
        """Compile ``key`` (into the disk cache, when there is one) and return the callable kernel.
        With a disk directory the kernel is compiled for export only and loaded back from its
        entry, the way a warm process loads it: the DSL then builds no in-process JIT engine for
        its host code (~0.1-0.2 s of a cold first call). Where the entry cannot be written or
        loaded, it is compiled again with the engine. The garbage collector pauses meanwhile
        (``_GcPause``)."""
        with _GC_PAUSED:
            if self._disk is not None:
                token = _JIT_ENGINE.set(False)
                try:
                    exported = self._built(key)
                finally:
                    _JIT_ENGINE.reset(token)
                if self._store(key, exported):
                    fn = self._load(key)
                    if fn is not None:
                        return fn
            return self._built(key)

    def _built(self, key):
        """``key`` compiled, counted, and the candidate it took recorded."""
        fn = self._build(key)
        self.builds += 1
        self._chosen[key] = getattr(fn, "traits", None)
        return fn

    def chosen(self, key):
        """The candidate traits the kernel for ``key`` was compiled with (after ``get``)."""
        self.get(key)
        return self._chosen.get(key)

    def __contains__(self, key) -> bool:
        return key in self._fns

    def clear(self) -> None:
        with self._lock:
            self._fns.clear()
            self._slots.clear()

    # -- disk
    def _path(self, key) -> Path:
        digest = hashlib.sha256(pickle.dumps((key, _source_fingerprint()))).hexdigest()[:32]
        return self._disk / f"{digest}.o"

    @contextmanager
    def _disk_lock(self, key):
        """An exclusive lock on this key's entry across processes (POSIX ``flock``; none elsewhere
        or where the directory cannot be written)."""
        handle = None
        if self._disk is not None:
            try:
                import fcntl

                self._disk.mkdir(parents=True, exist_ok=True)
                handle = open(self._path(key).with_suffix(".lock"), "a")
                fcntl.flock(handle, fcntl.LOCK_EX)
            except (ImportError, OSError):
                if handle is not None:
                    handle.close()
                handle = None
        try:
            yield
        finally:
            if handle is not None:
                handle.close()  # releases the lock

    def _load(self, key):
        path = self._path(key) if self._disk is not None else None
        if path is None:
            return None
        try:
            index = int(path.with_suffix(".choice").read_text())
        except (OSError, ValueError):  # no entry (or a foreign one)
            return None
        # the shared library (no DSL import), else the object file; a stale, truncated or foreign
        # entry is a miss: recompiled and replaced
        fn = _load_shared_library(path.with_suffix(".so"), self.EXPORT_NAME) or _load_object(path, self.EXPORT_NAME)
        if fn is None:
            return None
        candidates = getattr(key, "candidates", None)
        self._chosen[key] = candidates[index] if candidates else None
        return fn

    def _store(self, key, fn) -> bool:
        """Write ``fn``'s entry; False where it could not be written."""
        if self._disk is None:
            return False
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._disk.mkdir(parents=True, exist_ok=True)
            chosen, candidates = getattr(fn, "traits", None), getattr(key, "candidates", None)
            # the choice first: a reader that finds the object finds its choice complete too
            tmp.write_text(str(candidates.index(chosen) if candidates else 0))
            os.replace(tmp, path.with_suffix(".choice"))
            fn.export_to_c(object_file_path=str(tmp), function_name=self.EXPORT_NAME)
            _link_shared_library(tmp, path.with_suffix(".so"))
            os.replace(tmp, path)
            return True
        except Exception:  # a read-only or full disk costs the cache, never the call
            tmp.unlink(missing_ok=True)
            return False


class KernelSlot:
    """``KernelCache.slot``'s callable: ``traits`` are the candidate compiled (the bootstrap's
    while it runs; both compute the same results with the same launch arguments)."""

    __slots__ = ("_cache", "_key", "fn", "traits", "_pending")

    def __init__(self, cache: KernelCache, key, fn, traits, pending: threading.Event | None = None):
        self._cache, self._key, self.fn, self.traits, self._pending = cache, key, fn, traits, pending

    @property
    def bootstrapped(self) -> bool:
        """Whether the bootstrap kernel still runs (the background build has not ended)."""
        return self._pending is not None

    def current(self):
        """The kernel to run now: the key's once its background build has ended (loaded from the
        disk cache, or compiled here if that build failed), the bootstrap's until then."""
        if self._pending is not None and self._pending.is_set():
            self.fn, self.traits, self._pending = self._cache.get(self._key), self._cache.chosen(self._key), None
        return self.fn

    def __call__(self, *args):
        return self.current()(*args)


class _BackgroundBuilds:
    """Compiles keys into a disk cache in child processes (``python -c``, not multiprocessing,
    which would re-run an unguarded ``__main__``), each job in its own child, at most
    ``workers`` at a time, from daemon threads that only wait on them: the caller's thread keeps
    the GIL to itself. A child takes each key's file lock, so a process that needs a key still
    compiling waits for it and then loads it; one that needs a key no child has started compiles
    it itself (the child then finds it on disk); if a child dies, its lock is released."""

    _CHILD = ("import pickle, sys; job = pickle.load(sys.stdin.buffer); sys.path[:0] = job['path']; "
              "from cute_attn.compile import _build_into; _build_into(job['dir'], job['keys'])")

    def __init__(self, workers: int = 2):
        self._workers = workers
        self._jobs: list = []
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._busy = 0

    def submit(self, disk_dir: str, keys: list, done: threading.Event | None = None, first: bool = False) -> None:
        """Compile ``keys`` into ``disk_dir`` in a child; ``done`` is set when the child ends
        (whether or not it built them); ``first``: ahead of the jobs still waiting."""
        with self._cond:
            self._jobs.insert(0 if first else len(self._jobs), (disk_dir, keys, done))
            if len(self._threads) < min(self._workers, len(self._jobs) + self._busy):
                thread = threading.Thread(target=self._run, name="cute_attn-background-build", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job is done (tests and tools); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self) -> None:
        import subprocess
        import sys

        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs)
                disk_dir, keys, done = self._jobs.pop(0)
                self._busy += 1
            try:
                os.makedirs(disk_dir, exist_ok=True)
                job = pickle.dumps(dict(path=[p for p in sys.path if p], dir=disk_dir, keys=keys))
                with open(os.path.join(disk_dir, "background.log"), "ab") as log:
                    subprocess.run([sys.executable, "-c", self._CHILD], input=job, stdout=log, stderr=log,
                                   timeout=1800)
            except Exception:  # a failed background build costs only the prefetch: get() builds
                pass
            if done is not None:
                done.set()
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()


_BACKGROUND = _BackgroundBuilds()


def wait_for_background_builds(timeout: float | None = None) -> bool:
    """Block until the background builds submitted so far are done; False on timeout."""
    return _BACKGROUND.wait(timeout)


def _build_into(disk_dir: str, keys) -> None:
    """The background child: compile ``keys`` into ``disk_dir`` (and each backward main kernel's
    postprocess, whose key follows the traits the main kernel was compiled with)."""
    try:
        os.nice(5)  # behind the foreground process on a busy host
    except OSError:
        pass
    cache = KernelCache(build, disk_dir)
    for key in keys:
        cache.get(key)
        if isinstance(key, BackwardKey):
            cache.get(backward_post_key(key, cache.chosen(key)))


def _load_shared_library(path: Path, name: str):
    """The kernel ``name`` from a cache entry's shared library, through TVM-FFI alone (None: none
    there, or it does not load)."""
    if not path.exists():
        return None
    try:
        import tvm_ffi

        return tvm_ffi.load_module(str(path))[name]
    except Exception:
        return None


def _load_object(path: Path, name: str):
    """The kernel ``name`` from a cache entry's object file, through the DSL's runtime (None: none
    there, or it does not load)."""
    if not path.exists():
        return None
    try:
        import cutlass.cute as cute

        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
    except Exception:
        return None


def _link_shared_library(obj: Path, target: Path) -> None:
    """Link an exported object with the DSL's runtime and TVM-FFI libraries (found where they are
    installed; their directories go into the library's run path) into ``target``. Best effort: no
    C compiler or a failed link leaves the entry with its object file only."""
    import shutil
    import subprocess

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return
    from cutlass.runtime import find_runtime_libraries

    libraries = find_runtime_libraries(enable_tvm_ffi=True)
    run_path = [f"-Wl,-rpath,{d}" for d in sorted({os.path.dirname(lib) for lib in libraries})]
    tmp = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.so.tmp")
    try:
        # every symbol resolved at link time and bound at load time: a library that could not run
        # is never written, or fails to load (then the object file serves), never fails mid-call
        flags = ["-Wl,--no-undefined", "-Wl,-z,now"]
        done = subprocess.run([compiler, "-shared", "-o", str(tmp), str(obj), *libraries, *run_path, *flags],
                              capture_output=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        tmp.unlink(missing_ok=True)


_FINGERPRINT: str | None = None


def _source_fingerprint() -> str:
    """Hash of what a compiled kernel depends on (the kernel sources, this file, traits.py, whose
    constants the kernels import, the DSL version): a change there invalidates the disk entries."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        # the installed versions from package metadata: importing the DSL here would cost a
        # cache hit the import it saves (see _load_shared_library)
        from importlib import metadata

        def version(dist: str) -> str:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return ""

        h = hashlib.sha256(f"{version('nvidia-cutlass-dsl')} {version('apache-tvm-ffi')}".encode())
        root = Path(__file__).parent
        for path in sorted([Path(__file__), root / "traits.py", *(root / "kernels").rglob("*.py")]):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
        _FINGERPRINT = h.hexdigest()
    return _FINGERPRINT


def build(key, keep_artifacts: bool = False):
    """Compile any kernel key (forward, backward main, backward pre/postprocess, split-KV combine,
    ring merge)."""
    if isinstance(key, ForwardKey):
        return build_forward(key, keep_artifacts)
    if isinstance(key, CombineKey):
        return build_combine(key, keep_artifacts)
    if isinstance(key, RingMergeKey):
        return build_ring_merge(key, keep_artifacts)
    return build_backward(key, keep_artifacts)


def forward_tier_siblings(key: ForwardKey) -> list[ForwardKey]:
    """The keys built together with ``key`` on its first use, ``key`` among them, so that no later
    length compiles: which of them a call runs follows its lengths.
    - an SM90 table key: every length tier of its configuration;
    - a table key of a dense (not varlen) forward: also the split-KV kernel that ``forward`` runs
      when few query rows meet many keys (interface._underfilled);
    - a KV-cache decode key, or a paged varlen one (flash_attn_varlen_func's block_table): the same
      kernel with split-KV toggled (the split count follows the cache length,
      interface.decode_num_splits);
    - and for those and the SM90 paged keys, where the call's lengths can move it (``_paged_route_keys``).
    An explicit-traits key has no siblings."""
    if key.kernel == "sm80" and (key.features.decode or key.features.paged):
        return list(dict.fromkeys([key, _with_features(key, split=not key.features.split)]
                                  + _paged_route_keys(key)))
    if key.kernel == "sm90":
        siblings = _sm90_tier_keys(key)
    else:
        siblings = [key] if key.candidates == sm80_forward_traits(key.head_dim, key.causal) else []
    if key not in siblings:
        return [key]
    if not (key.features.varlen or key.features.decode):
        siblings.append(forward_split_key(key.target, key.dtype, key.head_dim - 8 * key.check_hdim, key.causal,
                                          key.features))
    if key.kernel == "sm90" and key.features.paged:
        siblings = list(dict.fromkeys(siblings + _paged_route_keys(key)))
    return siblings


def _sm90_tier_keys(key: ForwardKey) -> list[ForwardKey]:
    """Every length tier of an SM90 table key's configuration (tiers that a feature makes alike,
    as causal varlen's, once)."""
    return list(dict.fromkeys(
        ForwardKey(key.kernel, key.target, key.dtype, key.head_dim, key.causal, key.check_hdim,
                   _sm90_for_features(sm90_forward_traits(key.head_dim, key.causal, None, tier), key.features,
                                      key.causal),
                   key.features)
        for tier in sm90_seqlen_tiers(key.head_dim, key.causal)
    ))


def _paged_route_keys(key: ForwardKey) -> list[ForwardKey]:
    """The kernels a paged or KV-cache call can move to as its lengths change, on sm_90a: the queries
    per sequence pick the decode kernel or the SM90 forward, and whether that packs GQA
    (kvcache.sm90_paged_varlen). From a decode key: the SM90 forward's keys, packed and not (every
    tier); from an SM90 paged key: the other packing and the paged varlen call's decode keys (pages
    of 16 and of 64 keys, split and not). Other page sizes' decode keys are not guessed."""
    f = key.features
    if key.target != "sm_90a" or not (f.paged or f.kvcache):
        return []
    head_dim = key.head_dim - 8 * key.check_hdim  # a head dim that pads to the key's, as the key's own
    scores = dict(local=f.local, softcap=f.softcap, alibi=f.alibi)
    route = []
    for pack in (False,) if f.alibi else (False, True):
        sm90 = Features(**scores, varlen=True, seqused=True, paged=True, pack_gqa=pack)
        sm90_key = forward_key(key.target, key.dtype, head_dim, key.causal, kernel="sm90", features=sm90,
                               page_size=SM90_PAGE_ROWS)
        if sm90_key.kernel == "sm90":
            route += _sm90_tier_keys(sm90_key)
    if key.kernel == "sm90":
        decode = Features(**scores, varlen=True, seqused=True, paged=True, split=True, pack_gqa=not f.alibi)
        for page_size in (SM90_PAGE_ROWS, PAGE_BLOCK_MIN):
            decode_key = forward_key(key.target, key.dtype, head_dim, key.causal, features=decode,
                                     page_size=page_size)
            route += [decode_key, _with_features(decode_key, split=False)]
    return [k for k in route if k != key]


def _with_features(key: ForwardKey, **changes) -> ForwardKey:
    return dataclasses.replace(key, features=dataclasses.replace(key.features, **changes))


def forward_split_key(target: str, dtype: str, head_dim: int, causal: bool, features: Features,
                      split: bool = True) -> ForwardKey:
    """The decode kernel that ``forward``'s split-KV path (and, with ``kvcache``, the KV-cache
    path) runs for these options: packed GQA unless ALiBi (whose slope is per head, not per row)."""
    decode = dataclasses.replace(features, split=split, pack_gqa=not features.alibi)
    return forward_key(target, dtype, head_dim, causal, features=decode)


def forward_bootstrap_key(key: ForwardKey) -> ForwardKey | None:
    """The kernel a cold start runs while ``key`` compiles in the background (KernelCache.slot):
    an SM90 forward with the intra-warpgroup overlap, as the same traits without it and with every
    K/V block through the masked path (``mask_every_block``). Its results are bitwise the same
    (the overlap reorders instructions, not arithmetic; the masks are no-ops inside the edges:
    tests/test_forward_gpu.py) and it compiles faster (d128 causal: 2.0 s against 2.7 s on the
    H100's host, 0.88 against 1.5-1.7 s on the CPU machine; docs/performance.md), running up to 25%
    slower until the full kernel lands.
    None for keys of several candidates (the bootstrap could take another one)."""
    if key.kernel != "sm90" or len(key.candidates) != 1 or not key.candidates[0].intra_wg_overlap:
        return None
    boot = dataclasses.replace(key.candidates[0], intra_wg_overlap=False, mask_every_block=True)
    return dataclasses.replace(key, candidates=(boot,))


forward_cache = KernelCache(build_forward, default_cache_dir(), group=forward_tier_siblings, background=True,
                            bootstrap=forward_bootstrap_key)
backward_cache = KernelCache(build_backward, default_cache_dir(), group=backward_tier_siblings, background=True)


def forward_variants(
    targets: Iterable[str] = TARGETS,
    head_dims: Iterable[int] = (32, 64, 96, 128, 192, 256),
    dtypes: Iterable[str] = DTYPES,
    causal: Iterable[bool] = (False, True),
    kernels: Iterable[str] = ("sm80", "sm90"),
    features: Iterable[Features] = (NO_FEATURES,),
) -> list[ForwardKey]:
    """Every forward variant over the given axes (ahead-of-time lists for tools/ and tests): each
    kernel family on each target it runs on (SM90 only on sm_90a)."""
    keys = {
        forward_key(target, dtype, d, c, kernel=kernel, seqlen=seqlen, features=f): None
        for f in features
        for kernel in kernels
        for target in targets
        if kernel == "sm80" or target == "sm_90a"
        for d in head_dims
        for dtype in dtypes
        for c in causal
        for seqlen in (sm90_seqlen_tiers(d, c) if kernel == "sm90" else (0,))
    }
    return list(keys)


def backward_variants(
    targets: Iterable[str] = TARGETS,
    head_dims: Iterable[int] = (32, 64, 96, 128, 192, 256),
    dtypes: Iterable[str] = DTYPES,
    causal: Iterable[bool] = (False, True),
    deterministic: Iterable[bool] = (False,),
    spec: str | None = None,
    kernels: Iterable[str] = ("sm80", "sm90"),
    features: Iterable[Features] = (NO_FEATURES,),
) -> list:
    """Every backward kernel (pre/main/post, deduplicated) over the given axes: each kernel family
    on each target it runs on (SM90 on sm_90a, where head dims without an SM90 entry fall back to
    SM80); ``spec`` (e.g. 'm64n128w8a2b4c2' or 'm64n128s2') replaces the traits table."""
    from cute_attn.traits import parse_backward_traits

    keys: dict = {}
    for kernel in kernels:
        for target in targets:
            if spec is None and kernel == "sm90" and target != "sm_90a":
                continue
            for d in head_dims:
                traits = parse_backward_traits(spec, d) if spec else None
                if traits is not None and isinstance(traits, Sm90BackwardTraits) and target != "sm_90a":
                    continue
                for dtype in dtypes:
                    for c in causal:
                        for det in deterministic:
                            for f in features:
                                pre, main = backward_keys(target, dtype, d, c, det, traits=traits, kernel=kernel,
                                                          features=f)
                                keys[pre] = None
                                # with the tiers the runtime builds beside it (long causal, Stream-K)
                                tiers = () if traits else (backward_long_key(main), backward_stream_k_key(main))
                                for m in filter(None, (main, *tiers)):
                                    keys[m] = None
                                    for chosen in m.candidates:  # whichever the main kernel ends up with
                                        keys[backward_post_key(m, chosen)] = None
    return list(keys)


# ---------------------------------------------------------------------------- split-KV combine
@dataclass(frozen=True)
class CombineKey:
    """The split-KV combine (kernels/combine.py): merges the fp32 partial O and LSE of the splits.
    num_splits, batch, seqlen_q, heads and the actual head dim are run-time values."""

    target: str
    dtype: str
    head_dim: int  # padded head dim
    check_hdim: bool  # actual head dim < padded head dim

    @property
    def name(self) -> str:
        return f"combine_{self.target}_{self.dtype}_d{self.head_dim}{'_padded' if self.check_hdim else ''}"


def combine_key(target: str, dtype: str, head_dim: int) -> CombineKey:
    """The combine kernel for outputs of head dim ``head_dim`` (the actual one)."""
    padded = padded_head_dim(head_dim)
    return CombineKey(target, dtype, padded, head_dim != padded)


def _fake_combine_tensors(dtype):
    """o_accum (splits, batch, seqlen_q, heads, d) and lse_accum (splits, batch, heads, seqlen_q) fp32
    (contiguous; any strides with the last one 1 and the others 16-byte multiples for o_accum), o
    (batch, seqlen_q, heads, d) like q and lse (batch, heads, seqlen_q), all shapes symbolic."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    sym, sym64 = cute.sym_int, cute.sym_int64
    splits, batch, seqlen_q, heads, head_dim = (sym() for _ in range(5))
    f32 = cutlass.Float32
    o_accum = make_fake_tensor(f32, (splits, batch, seqlen_q, heads, head_dim),
                               stride=tuple(sym64(divisibility=4) for _ in range(4)) + (1,), assumed_align=16)
    lse_accum = make_fake_tensor(f32, (splits, batch, heads, seqlen_q), stride=(sym64(), sym64(), sym64(), 1),
                                 assumed_align=4)
    o = make_fake_tensor(dtype, (batch, seqlen_q, heads, head_dim),
                         stride=tuple(sym64(divisibility=8) for _ in range(3)) + (1,), assumed_align=16)
    lse = make_fake_tensor(f32, (batch, heads, seqlen_q), stride=(sym64(), sym64(), 1), assumed_align=4)
    return o_accum, lse_accum, o, lse


def build_combine(key: CombineKey, keep_artifacts: bool = False):
    """Compile the split-KV combine for ``key`` (no GPU needed). The result is called as
    ``fn(o_accum, lse_accum, out, lse)`` with torch tensors, on torch's current stream."""
    import cutlass.cute as cute

    from cute_attn.kernels.combine import SplitCombine

    kernel = SplitCombine(_cutlass_dtype(key.dtype), key.head_dim, key.check_hdim)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(kernel, *_fake_combine_tensors(_cutlass_dtype(key.dtype)), stream, target=key.target,
                    keep_artifacts=keep_artifacts)


combine_cache = KernelCache(build_combine, default_cache_dir())


# ---------------------------------------------------------------------------- ring attention's merge
@dataclass(frozen=True)
class RingMergeKey:
    """Ring attention's per-step merge (kernels/ring_merge.py): folds a step's output and LSE into
    the fp32 accumulators. batch, rows, heads and the actual head dim are run-time values."""

    target: str
    dtype: str  # the step output's dtype
    head_dim: int  # padded head dim
    check_hdim: bool  # actual head dim < padded head dim
    indexed: bool  # step rows fold into accumulator rows through an int32 index (varlen halves)

    @property
    def name(self) -> str:
        return (f"ring_merge_{self.target}_{self.dtype}_d{self.head_dim}{'_padded' if self.check_hdim else ''}"
                f"{'_indexed' if self.indexed else ''}")


def ring_merge_key(target: str, dtype: str, head_dim: int, indexed: bool) -> RingMergeKey:
    padded = padded_head_dim(head_dim)
    return RingMergeKey(target, dtype, padded, head_dim != padded, bool(indexed))


def build_ring_merge(key: RingMergeKey, keep_artifacts: bool = False):
    """Compile the ring merge for ``key`` (no GPU needed). The result is called as ``fn(acc, acc_lse,
    part, part_lse, row_index_or_None)`` with torch tensors (acc (batch, acc rows, heads, d) and
    part (batch, rows, heads, d) with the last stride 1 and the others multiples of 4 (acc) / 8
    (part) elements; acc_lse (batch, heads, acc rows) and part_lse (batch, heads, rows) with the
    last stride 1; row_index (rows,) int32), on torch's current stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from cute_attn.kernels.ring_merge import RingMerge

    sym, sym64, f32 = cute.sym_int, cute.sym_int64, cutlass.Float32
    dtype = _cutlass_dtype(key.dtype)
    batch, acc_rows, rows, heads, head_dim = (sym() for _ in range(5))
    acc = make_fake_tensor(f32, (batch, acc_rows, heads, head_dim),
                           stride=tuple(sym64(divisibility=4) for _ in range(3)) + (1,), assumed_align=16)
    acc_lse = make_fake_tensor(f32, (batch, heads, acc_rows), stride=(sym64(), sym64(), 1), assumed_align=4)
    part = make_fake_tensor(dtype, (batch, rows, heads, head_dim),
                            stride=tuple(sym64(divisibility=8) for _ in range(3)) + (1,), assumed_align=16)
    part_lse = make_fake_tensor(f32, (batch, heads, rows), stride=(sym64(), sym64(), 1), assumed_align=4)
    index = make_fake_tensor(cutlass.Int32, (rows,), stride=(1,), assumed_align=4) if key.indexed else None
    kernel = RingMerge(dtype, key.head_dim, key.check_hdim, key.indexed)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile(kernel, acc, acc_lse, part, part_lse, index, stream, target=key.target,
                    keep_artifacts=keep_artifacts)


ring_merge_cache = KernelCache(build_ring_merge, default_cache_dir())
