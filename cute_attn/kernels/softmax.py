"""Online softmax over the rows of S tiles, in the log2 domain (FlashAttention-2, section 3.1).

Per row the kernel keeps the running max ``m`` (of raw scores) and a running sum ``l`` of
exp2(s * scale_log2 - m * scale_log2), where scale_log2 = softmax_scale * log2(e): one FFMA and
one exp2 per element. When a new tile raises the max, the running O and ``l`` are rescaled once by
exp2((m_old - m_new) * scale_log2). After the last tile, O is divided by ``l`` once and
LSE = (m * scale_log2 + log2(l)) * ln(2).

Each row of an MMA accumulator is spread over the 4 threads of a quad: the max is reduced over
the quad every tile (it sets the exponent), the sum only once in ``finalize``.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_attn.kernels.layout import acc_to_rows_cols

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


def _row_max(row: cute.Tensor) -> Float32:
    """Max of one thread's part of a row, in four independent chains (a single chain of dependent
    max instructions would put its whole latency on the softmax's critical path). Plain Python:
    every loop here unrolls at trace time."""
    n = cute.size(row)
    chains = min(4, n)
    acc = [row[i] for i in range(chains)]
    for i in range(chains, n):
        acc[i % chains] = cute.arch.fmax(acc[i % chains], row[i])
    while len(acc) > 1:
        acc = [cute.arch.fmax(acc[i], acc[i + 1]) if i + 1 < len(acc) else acc[i] for i in range(0, len(acc), 2)]
    return acc[0]


class OnlineSoftmax:
    """Running row statistics for the rows of one thread's accumulator fragment."""

    def __init__(self, scale_log2: Float32, num_rows: int, threads_per_row: int = 4):
        self.scale_log2 = scale_log2
        self.threads_per_row = threads_per_row
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        self.reset()

    def reset(self):
        """Fresh statistics, for the next tile of rows."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_S: cute.Tensor, acc_O: cute.Tensor, check_inf: cutlass.Constexpr[bool] = True):
        """``update`` then ``rescale``: for kernels whose O is not being written while S is turned into P."""
        self.rescale(acc_O, self.update(acc_S, check_inf))

    @cute.jit
    def update(self, acc_S: cute.Tensor, check_inf: cutlass.Constexpr[bool] = True) -> cute.Tensor:
        """Turn the scores in ``acc_S`` into unnormalised probabilities P in place, fold them into
        the running max and sum, and return the per-row factor the running O must be multiplied by
        (``rescale``). Split from the rescale so that a kernel can run this while an asynchronous
        O += P V of the previous block is still in flight (SM90).

        ``check_inf``: a row may still be fully masked (max -inf); then 0 is used as the exponent
        offset so that exp2(-inf - -inf) does not give NaN. Without it (no causal mask) every row
        has a finite max from the first block on. The first block needs no special case: the
        running max starts at -inf, so its rescale factor is exp2(-inf) = 0 on a zero O and sum.
        """
        S = acc_to_rows_cols(acc_S)
        factors = cute.make_fragment_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = S[r, None].load()
            m_tile = _row_max(S[r, None])
            m_tile = cute.arch.warp_reduction_max(m_tile, threads_in_group=self.threads_per_row)
            m_old = self.row_max[r]
            m_new = cute.arch.fmax(m_tile, m_old)
            self.row_max[r] = m_new
            if const_expr(check_inf):
                m_new = 0.0 if m_new == -Float32.inf else m_new
            m_scaled = m_new * self.scale_log2
            rescale = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
            p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
            S[r, None].store(p)
            self.row_sum[r] = self.row_sum[r] * rescale + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            factors[r] = rescale
        return factors

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, factors: cute.Tensor):
        """Multiply each row of the running O by its factor from ``update``."""
        O = acc_to_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(factors)):
            O[r, None].store(O[r, None].load() * factors[r])

    @cute.jit
    def finalize(self, acc_O: cute.Tensor) -> cute.Tensor:
        """Normalise ``acc_O`` by the row sums and return the natural-log LSE per row.

        A row that saw no key (sum 0) gets O = 0 and LSE = +inf, so that the backward's
        exp(S - LSE) is exactly 0 for it."""
        O = acc_to_rows_cols(acc_O)
        lse = cute.make_fragment_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=self.threads_per_row)
            empty = total == 0.0 or total != total
            inv = cute.arch.rcp_approx(1.0 if empty else total)
            # an explicit fma: left to the compiler, max * scale + log2 is fused or not depending on
            # the code around it (a product of the last block's max reused, unfused), and kernels
            # that must write the same bits would not (compile.forward_bootstrap_key)
            lse[r] = (
                Float32.inf
                if empty
                else cute.math.fma(self.row_max[r], self.scale_log2, cute.math.log2(total, fastmath=True)) * LN2
            )
            O[r, None].store(O[r, None].load() * (0.0 if empty else inv))
        return lse
