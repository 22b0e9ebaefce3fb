"""Register-fragment views shared by the kernels.

An MMA accumulator fragment is indexed by the MMA's own modes (values, MMA_M, MMA_N). The softmax
and the masks want to walk it by (row, column) instead, and the second GEMM wants the fp16/bf16 copy
of S in the A-operand layout. These helpers build those views without moving any data.
"""

import cutlass.cute as cute
from cutlass import const_expr


def acc_to_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator (or a coordinate tensor partitioned like one) as this thread's (rows, cols).

    SM80 m16n8k16: values are (2 cols, 2 rows) -> ((2, MMA_M), (2, MMA_N)).
    SM90 wgmma:    values are (2 cols, 2 rows, N/8) -> ((2, MMA_M), (2, N/8, MMA_N)).
    Built over the compact index layout and composed, so it works for any element layout.
    """
    idx = cute.make_layout(acc.layout.shape)
    vals = idx[0]
    rows = ((vals.shape[1], idx.shape[1]), (vals.stride[1], idx.stride[1]))
    if const_expr(cute.rank(vals) == 2):
        cols = ((vals.shape[0], idx.shape[2]), (vals.stride[0], idx.stride[2]))
    else:
        cols = (
            (vals.shape[0], vals.shape[2], idx.shape[2]),
            (vals.stride[0], vals.stride[2], idx.stride[2]),
        )
    view = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def acc_to_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View the (converted) S accumulator as the A operand of the P @ V MMA.

    SM80: the m16n8k16 C fragment of two neighbouring n8 tiles is exactly one k16 A fragment,
    so ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
    SM90: ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)).
    """
    layout = acc.layout
    if const_expr(cute.rank(layout[0]) == 2):
        assert cute.size(layout.shape[2]) % 2 == 0, "tile_n must be a multiple of 16"
        d = cute.logical_divide(layout, (None, None, 2))
        view = cute.make_layout(
            ((d.shape[0][0], d.shape[0][1], d.shape[2][0]), d.shape[1], d.shape[2][1]),
            stride=((d.stride[0][0], d.stride[0][1], d.stride[2][0]), d.stride[1], d.stride[2][1]),
        )
    else:
        d = cute.logical_divide(layout, ((None, None, 2), None, None))
        view = cute.make_layout(
            ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
            stride=(
                (d.stride[0][0], d.stride[0][1], d.stride[0][2][0]),
                d.stride[1],
                (d.stride[0][2][1], d.stride[2]),
            ),
        )
    return cute.make_tensor(acc.iterator, view)


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols, ...) shared-memory tensor seen as (cols, rows, ...): V as the B operand of P @ V."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def convert(src: cute.Tensor, dtype) -> cute.Tensor:
    """Register copy of ``src`` converted to ``dtype`` (fp32 accumulators -> fp16/bf16 operands)."""
    dst = cute.make_fragment_like(src, dtype)
    dst.store(src.load().to(dtype))
    return dst


