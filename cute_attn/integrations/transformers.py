"""Hugging Face transformers: ``attn_implementation="cute_attn"``.

    import cute_attn.integrations.transformers  # registers "cute_attn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cute_attn", dtype=torch.bfloat16)

Importing this module registers, under the name ``"cute_attn"``, ``attention_forward`` with
transformers' ``AttentionInterface`` and ``padding_mask`` with its ``AttentionMaskInterface``.
The model then works as with ``"flash_attention_2"``: its mask is the 2D padding mask (batch, kv_len)
or None, never a 4D one, and on CUDA fp16/bf16 tensors cute_attn's kernels run, in the order
transformers' flash path takes:

- a padding mask: q/k/v unpadded to packed rows, ``flash_attn_varlen_func``, the output padded back
  (zeros at padded queries); prefill, decoding (one query) and chunked prefill (the last q_len of
  the mask's columns, left padding) as there. Keys past the mask (a static cache's unwritten
  slots) are cut off. Non-causal calls without a window keep every query and unpad only the keys
  (the mask pads keys only: encoders, cross attention).
- ``cu_seq_lens_q/k`` and ``max_length_q/k`` (``DataCollatorWithFlattening``): varlen as given.
- batch 1 with ``position_ids`` that restart (padding-free packing): varlen, a sequence starting
  wherever the positions return to their minimum.
- otherwise ``flash_attn_func`` (causal bottom-right aligned, as FlashAttention).

All of them take the module's ``sliding_window`` (window (w - 1, w - 1) once the keys outnumber w),
``softcap`` (Gemma 2), ``scaling`` and causality (``is_causal`` or ``module.is_causal``; one query
is not causal), GQA without repeating K/V, a V head dim below Q's (padded, the output cropped),
and autograd (training).

Everything else goes to transformers' SDPA path, so every model works and only the speed differs:
dropout, attention sinks (``s_aux``), ``position_bias``, paged caches, ``output_attentions``, fp32
or CPU tensors, head dims cute_attn lacks (a multiple of 8 up to 256, K's equal to Q's), and masks
the flash path cannot express (for these the mask function hands over SDPA's 4D mask: chunked
attention, image-token overlays, bidirectional sliding windows, custom 4D masks). There the 4D
boolean mask SDPA needs is built here from the padding mask, packing, causality and window (queries
at the last q_len of the kv_len positions); softcap, sinks and ``output_attentions`` run a plain
masked softmax instead, as transformers' eager attention computes them.
transformers is an optional dependency: ``pip install cute-attn[transformers]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import cute_attn
from cute_attn.traits import MAX_HEAD_DIM

NAME = "cute_attn"
_DTYPES = (torch.float16, torch.bfloat16)
_DEVICES = ("cuda",)  # where the kernels run (the CPU tests add "cpu" with a reference in their place)


# ---------------------------------------------------------------------------- the mask function
# masking_utils' pattern functions the flash path reproduces on its own (from the module's causality,
# its sliding_window and the position_ids); other patterns get SDPA's 4D mask
_FLASH_PATTERNS = frozenset({
    "causal_mask_function",
    "bidirectional_mask_function",
    "and_masks.<locals>.and_mask",
    "sliding_window_overlay.<locals>.inner_mask",  # causal sliding window: kv > q - w
    "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
})


def pattern_parts(mask_function) -> set[str] | None:
    """The masking_utils functions a pattern is built from (walking the closures of and_masks and
    the packing wrappers), or None when a part is not one of those the flash path reproduces on its
    own: causal or full attention, a causal sliding window, packed sequences."""
    if (getattr(mask_function, "__module__", None) != masking_utils.__name__
            or getattr(mask_function, "__qualname__", None) not in _FLASH_PATTERNS):
        return None
    parts = {mask_function.__qualname__}
    for cell in mask_function.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for part in held if isinstance(held, tuple) else (held,):
            if callable(part) and not isinstance(part, torch.Tensor):
                inner = pattern_parts(part)
                if inner is None:
                    return None
                parts |= inner
    return parts


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=masking_utils.causal_mask_function, attention_mask: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor | None:
    """The mask attention_forward receives: the (batch, <= kv_length) boolean padding mask, None when
    no key is padded, as transformers' ``flash_attention_mask``; SDPA's 4D mask for a pattern the
    flash path cannot express. A static cache without a mask (generate drops an all-ones mask for
    implementations not named flash) gets an all-ones mask over the written slots, so that the
    unwritten ones are cut off as with a padding mask (causal patterns only: those slots lie after
    every query)."""
    parts = pattern_parts(mask_function)
    if parts is None:
        kwargs["allow_is_causal_skip"] = False  # a None here would mean SDPA's top-left causal mask
        kwargs.pop("allow_is_bidirectional_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if kv_length > q_length and "causal_mask_function" in parts:  # (cross attention's keys all count)
        written = int(q_offset) + q_length - int(kv_offset)
        if written < kv_length:
            device = kwargs.get("device", "cpu")
            return torch.ones(batch_size, written, dtype=torch.bool, device=device)
    return None


# ---------------------------------------------------------------------------- varlen helpers
def unpad_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """From a (batch, seqlen) mask (nonzero: kept): the flat indices of the kept tokens (int64, into
    batch * seqlen rows), cu_seqlens (int32, batch + 1) and the longest sequence (an int)."""
    mask = mask.bool()
    lengths = mask.sum(dim=1, dtype=torch.int32)
    indices = mask.reshape(-1).nonzero().reshape(-1)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, ...) -> (len(indices), ...): the rows at the flat indices."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices)


def pad_rows(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``gather_rows``: (total, ...) -> (batch, seqlen, ...), zeros elsewhere."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:])
    return out.index_copy(0, indices, x).view(batch, seqlen, *x.shape[1:])


def varlen_from_mask(query, key, value, mask: torch.Tensor, keep_all_queries: bool = False):
    """Unpad (batch, len, heads, d) q/k/v by a 2D padding mask (batch, kv_len), as transformers' flash
    path does. The keys past the mask's length (a static cache's unwritten slots) are dropped. Queries:
    q_len == kv_len: the mask's rows; q_len == 1 (decoding): one per sequence; otherwise the mask's
    last q_len columns (chunked prefill; left padding). ``keep_all_queries``: every query row.
    Returns q, k, v (total, heads, d), the query indices (for ``pad_rows``), cu_seqlens_q,
    cu_seqlens_k and the max lengths."""
    batch, q_len = query.shape[:2]
    kv_len = mask.shape[1]
    key, value = key[:, :kv_len], value[:, :kv_len]
    indices_k, cu_k, max_k = unpad_indices(mask)
    key, value = gather_rows(key, indices_k), gather_rows(value, indices_k)
    if keep_all_queries or q_len == 1:
        cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=query.device)
        indices_q, max_q = torch.arange(batch * q_len, device=query.device), q_len
        query = query.reshape(batch * q_len, *query.shape[2:])
    elif q_len == kv_len:
        indices_q, cu_q, max_q = indices_k, cu_k, max_k
        query = gather_rows(query, indices_q)
    else:
        indices_q, cu_q, max_q = unpad_indices(mask[:, -q_len:])
        query = gather_rows(query, indices_q)
    return query, key, value, indices_q, cu_q, cu_k, max_q, max_k


def is_packed(position_ids: torch.Tensor | None, batch: int, q_len: int) -> bool:
    """Padding-free packing: batch 1 and positions that are not one run counting up from their first
    (transformers' flash path: positions other than arange + min)."""
    if position_ids is None or batch != 1 or q_len < 2 or position_ids.dim() != 2 or position_ids.shape != (1, q_len):
        return False
    positions = position_ids[0]
    return bool((positions != torch.arange(q_len, device=positions.device) + positions[0]).any())


def varlen_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) and the longest sequence of a packed (1, total) position_ids: a sequence
    starts at row 0 and wherever the positions return to their minimum."""
    positions = position_ids.reshape(-1)
    total = positions.numel()
    starts = (positions == positions.min()).nonzero().reshape(-1)
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), total)]).unique()  # sorted
    cu_seqlens = bounds.to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def window_for(sliding_window: int | None, kv_len: int) -> tuple[int, int]:
    """transformers' sliding_window (the keys a query sees, itself included) as FlashAttention's
    window_size, applied once the keys outnumber it."""
    if sliding_window is not None and kv_len > sliding_window:
        return sliding_window - 1, sliding_window - 1
    return -1, -1


# ---------------------------------------------------------------------------- the fallback's mask
def visibility_mask(q_segment, q_position, k_segment, k_position, causal: bool,
                    window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """(batch, 1, q, k) bool: query i sees key j iff both lie in one segment (ids >= 0; -1: padding),
    and, with causal, k_pos <= q_pos; with a window (left, right), q_pos - left <= k_pos <= q_pos +
    right (right 0 when causal). Segments (batch, q) / (batch, k), positions likewise (in one
    sequence's numbering)."""
    seen = (q_segment[:, :, None] == k_segment[:, None, :]) & (q_segment[:, :, None] >= 0)
    distance = q_position[:, :, None] - k_position[:, None, :]  # >= 0: the key lies before the query
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        seen &= distance <= left
    if right >= 0:
        seen &= distance >= -right
    return seen[:, None]


def _segments_from_cu(cu_seqlens: torch.Tensor, total: int, device, other: torch.Tensor | None = None):
    """Per row of a packed dim: the sequence id (-1 past the last sequence) and the position inside
    the sequence; with ``other`` (the other side's cu_seqlens) shifted to align the sequence ends
    (bottom-right, as FlashAttention aligns q to k)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    rows = torch.arange(total, device=device)
    segment = torch.searchsorted(cu[1:], rows, right=True)
    inside = segment < cu.numel() - 1
    segment = torch.where(inside, segment, torch.full_like(segment, -1))
    start = cu[segment.clamp(max=cu.numel() - 2)]
    position = rows - start
    if other is not None:
        lengths, other_lengths = cu.diff(), other.to(device=device, dtype=torch.long).diff()
        position = position + (other_lengths - lengths)[segment.clamp(max=cu.numel() - 2)]
    return segment[None], position[None]


def fallback_mask(query, key, attention_mask, causal: bool, window: tuple[int, int], kwargs):
    """The 4D boolean mask for SDPA that gives what the flash path computes (None: SDPA's is_causal
    serves), and the key length to use (a static cache's unwritten slots dropped)."""
    batch, q_len, kv_len, device = query.shape[0], query.shape[2], key.shape[2], query.device
    if attention_mask is not None:  # padding: positions in the padded rows, queries at the end
        kv_len = attention_mask.shape[1]
        mask = attention_mask.bool()
        ids = torch.arange(batch, device=device)[:, None]
        k_segment = torch.where(mask, ids, torch.full_like(ids, -1))
        k_position = torch.arange(kv_len, device=device).expand(batch, -1)
        q_rows = mask[:, -q_len:] if (causal or window != (-1, -1)) and q_len != 1 and q_len <= kv_len else None
        q_segment = ids.expand(batch, q_len) if q_rows is None else torch.where(q_rows, ids, torch.full_like(ids, -1))
        q_position = torch.arange(kv_len - q_len, kv_len, device=device).expand(batch, -1)
        return visibility_mask(q_segment, q_position, k_segment, k_position, causal, window), kv_len
    cu = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(c is not None for c in cu) and batch == 1:
        q_segment, q_position = _segments_from_cu(cu[0], q_len, device, other=cu[1])
        k_segment, k_position = _segments_from_cu(cu[1], kv_len, device)
        return visibility_mask(q_segment, q_position, k_segment, k_position, causal, window), kv_len
    position_ids = kwargs.get("position_ids")
    if q_len == kv_len and is_packed(position_ids, batch, q_len):
        cu_seqlens, _ = varlen_from_positions(position_ids)
        segment, position = _segments_from_cu(cu_seqlens, q_len, device)
        return visibility_mask(segment, position, segment, position, causal, window), kv_len
    if window == (-1, -1) and (not causal or q_len == kv_len):
        return None, kv_len  # SDPA's is_causal (top-left) is the flash path's mask here
    q_position = torch.arange(kv_len - q_len, kv_len, device=device)[None]
    k_position = torch.arange(kv_len, device=device)[None]
    zeros_q, zeros_k = torch.zeros_like(q_position), torch.zeros_like(k_position)
    return visibility_mask(zeros_q, q_position, zeros_k, k_position, causal, window), kv_len


def masked_softmax_attention(module, query, key, value, mask, dropout: float, scaling: float | None,
                             softcap: float | None, s_aux: torch.Tensor | None, position_bias=None):
    """transformers' eager attention with what SDPA lacks: softcap (Gemma 2) and attention sinks
    (``s_aux``, gpt-oss), over a 4D boolean or additive mask; returns ((batch, q, heads, d), probs)."""
    heads, heads_kv = query.shape[1], key.shape[1]
    if heads != heads_kv:
        key, value = (t.repeat_interleave(heads // heads_kv, dim=1) for t in (key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if s_aux is not None:
        sinks = s_aux.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing: zeros
    if s_aux is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout, training=module.training if module is not None else False).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def fallback(module, query, key, value, attention_mask, dropout: float, scaling, causal: bool, kwargs):
    """The call as SDPA (or, for softcap / sinks / attention probabilities, the eager softmax) runs
    it, with the mask the flash path would apply."""
    if kwargs.get("cache") is not None:  # a paged cache: transformers' SDPA path as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)
    softcap, s_aux = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    blind = None
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask  # the model's own 4D mask: as it is
    else:
        window = window_for(kwargs.get("sliding_window"), key.shape[2])
        mask, kv_len = fallback_mask(query, key, attention_mask, causal, window, kwargs)
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
        if mask is not None:
            blind = ~mask.any(dim=-1, keepdim=True)  # queries that see no key (padding): all keys, then zeros
            mask = mask | blind
    if softcap or s_aux is not None or kwargs.get("output_attentions"):
        if mask is None and causal:
            mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
        out, probs = masked_softmax_attention(module, query, key, value, mask, dropout, scaling, softcap, s_aux,
                                              kwargs.get("position_bias"))
    else:
        group = query.shape[1] // key.shape[1]
        if group > 1 and getattr(module, "num_key_value_groups", None) != group:  # (SDPA's GQA reads it there)
            key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
        out, probs = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                            is_causal=causal, **kwargs)
    if blind is not None:
        out = out.masked_fill(blind[:, 0, :, :, None], 0.0)  # (batch, q, 1, 1) over (batch, q, heads, d)
    return out, probs


# ---------------------------------------------------------------------------- attention_forward
def declined(module, query, key, attention_mask, dropout: float, kwargs, value=None) -> str | None:
    """Why this call goes to the fallback instead (None: cute_attn runs it)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        return "a 4D attention mask"
    if dropout:
        return "attention dropout"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    for name in ("position_bias", "cache"):
        if kwargs.get(name) is not None:
            return name
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if query.dtype not in _DTYPES or query.device.type not in _DEVICES:
        return "not a CUDA fp16/bf16 tensor"
    if 0 in query.shape or 0 in key.shape:
        return "an empty tensor"
    head_dim, heads, heads_kv = query.shape[3], query.shape[1], key.shape[1]
    if (head_dim % 8 or head_dim > MAX_HEAD_DIM or key.shape[3] != head_dim or heads % heads_kv
            or (value is not None and value.shape[3] > head_dim)):
        return "head dims or head counts cute_attn does not run"
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, q_len, d), key/value (batch,
    heads_kv, kv_len, d); attention_mask the 2D padding mask (``padding_mask``'s), or None; returns
    ((batch, q_len, heads, d), None)."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1  # one query token (decoding) sees every key
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > kv_len:
        attention_mask = attention_mask[:, -kv_len:]
    if declined(module, query, key, attention_mask, dropout, kwargs, value) is not None:
        return fallback(module, query, key, value, attention_mask, dropout, scaling, causal, dict(kwargs))
    sliding_window, softcap = kwargs.get("sliding_window"), float(kwargs.get("softcap") or 0.0)
    options = dict(softmax_scale=scaling, causal=causal, window_size=window_for(sliding_window, kv_len),
                   softcap=softcap)
    v_dim = value.shape[3]
    if v_dim != query.shape[3]:  # MLA: V padded up to the Q/K head dim, the output cropped back
        value = F.pad(value, (0, query.shape[3] - v_dim))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (batch, len, heads, d)

    cu = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if attention_mask is not None:
        keep_all = not causal and options["window_size"] == (-1, -1)  # only the keys are padding there
        q, k, v, indices_q, cu_q, cu_k, max_q, max_k = varlen_from_mask(q, k, v, attention_mask, keep_all)
        out = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        out = pad_rows(out, indices_q, batch, q_len)
    elif all(c is not None for c in cu):
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in cu[:2])
        out = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(cu[2]), int(cu[3]), **options)
        out = out.view(batch, -1, *out.shape[1:])
    elif q_len == kv_len and is_packed(kwargs.get("position_ids"), batch, q_len):
        cu_seqlens, longest = varlen_from_positions(kwargs["position_ids"])
        cu_seqlens = cu_seqlens.to(q.device)
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = cute_attn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **options)
        out = out.view(batch, q_len, *out.shape[1:])
    else:
        out = cute_attn.flash_attn_func(q, k, v, **options)
    if v_dim != query.shape[3]:
        out = out[..., :v_dim]
    return out, None


def register() -> None:
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


register()
