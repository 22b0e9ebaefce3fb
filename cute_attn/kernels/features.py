"""The optional attention features a kernel is compiled with (part of every compile key).

Each one changes the inner loop, so it is a compile-time flag: a kernel without it carries none of
its code. Their run-time values (window edges, the softcap, the ALiBi slopes, cu_seqlens) are
kernel arguments, so a new value never compiles.

- ``local``: a sliding window (window_left, window_right) in FlashAttention's bottom-right aligned
  sense; causal attention with a left window is local with window_right = 0.
- ``softcap``: scores = softcap * tanh(scores / softcap) (mask.apply_softcap).
- ``alibi``: the bias -slope * |i + seqlen_k - seqlen_q - j| per head (and batch).
- ``varlen``: packed sequences delimited by cu_seqlens_q / cu_seqlens_k (seqlen_info).
- ``seqused``: varlen with FlashAttention-3's ``seqused_k``: sequence b attends to its first
  seqused_k[b] keys only (an int32 (batch,) tensor; the rest of its K/V rows are ignored).

- ``paged``: K/V rows are gathered through a block table from (pages, page_size, heads_kv, d).
  The SM80-family forward reads a K/V block at a time from one page (the page size a multiple of
  its tile_n); the SM90 forward (varlen only: flash_attn_varlen_func's block_table) a piece of
  traits.SM90_PAGE_ROWS rows at a time (page sizes a multiple of that).

KV-cache decode (SM80-family forward only; interface.flash_attn_with_kvcache):
- ``kvcache``: per-sequence key counts, first key rows and cache batch rows come from int32
  tensors (cache_seqlens, cache_leftpad, cache_batch_idx) instead of the tensors' shapes.
- ``paged_rows``: with ``paged``, pages of any size: each row of a K/V block finds its own page
  (one block-table read per row a thread copies, where ``paged`` alone reads one per block).
- ``split``: the K/V range of each (Q block, head, sequence) is cut into run-time ``num_splits``
  pieces run by separate CTAs, each writing an fp32 partial O and LSE (kernels/combine.py merges).
- ``pack_gqa``: the query heads sharing a K/V head fill the rows of one tile with the queries,
  so each K/V block is read once per K/V head (the SM80-family forward: row p is query p // g of
  head p % g; the SM90 forward, varlen only: query p % (tile_m / g) of head p // (tile_m / g)).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Features:
    local: bool = False
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False
    seqused: bool = False
    kvcache: bool = False
    paged: bool = False
    paged_rows: bool = False
    split: bool = False
    pack_gqa: bool = False

    @property
    def suffix(self) -> str:
        """For kernel names: '_local_softcap', '' when none."""
        return "".join(f"_{name}" for name in FEATURE_NAMES if getattr(self, name))

    @property
    def seqused_k(self) -> bool:
        """Whether the kernel reads per-sequence key counts (``mSeqUsedK``): varlen's seqused_k or
        a KV cache's cache_seqlens."""
        return self.seqused or self.kvcache

    @property
    def decode(self) -> bool:
        """Any of the KV-cache decode features. The SM80-family forward has them all; the SM90
        forward has ``paged`` (not one of these) and ``pack_gqa`` with varlen (compile.forward_key)."""
        return self.kvcache or self.paged_rows or self.split or self.pack_gqa


FEATURE_NAMES = (
    "local", "softcap", "alibi", "varlen", "seqused", "kvcache", "paged", "paged_rows", "split", "pack_gqa",
)
NO_FEATURES = Features()


def parse_features(spec: str) -> Features:
    """'none' or names joined by commas ('local,softcap'): the command-line form of the tools."""
    names = [n for n in spec.split(",") if n and n != "none"]
    unknown = set(names) - set(FEATURE_NAMES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}: choose from {', '.join(FEATURE_NAMES)}, none")
    return Features(**{n: True for n in names})
