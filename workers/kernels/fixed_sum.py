"""Sums in a fixed order, whatever the launch shape.

``tl.sum`` adds a row's elements in an order set by the tensor's layout (how its
elements spread over registers, lanes and warps), and the layout follows the tile
shape and warp count. Two kernels that must give the same bits for the same row (the
one-row gemv and its multi-row form, the fused norm and the standalone one) sum with
``lane_sum`` instead: a binary tree over adjacent pairs, the same adds in the same
order for any layout (a two-element sum is exact in either order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lane_sum(x, ROWS: tl.constexpr, LANES: tl.constexpr):
    """x [ROWS, LANES] float32 (LANES a power of two) -> [ROWS]: lane 2i and 2i + 1 are
    added first, then those pairs' sums, and so on."""
    for level in tl.static_range(LANES.bit_length() - 1):
        x = tl.sum(tl.reshape(x, [ROWS, LANES >> (level + 1), 2]), 2)
    return tl.reshape(x, [ROWS])
