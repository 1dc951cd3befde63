"""The tile bound (``kernels/tile_bound.py``): its parameters and grid."""

import dataclasses
from typing import ClassVar

from .abi import WORKSPACE_POINTERS, KernelSpec, pointer, scalar

TILE_BOUND_PARAMS = (*WORKSPACE_POINTERS, pointer("bounds", "f32"), scalar("total_slots", "i32"))
TILE_BOUND_WARPS = 4  # slots per CTA, a warp each
# Added to every bound: covers the kernel's bf16 roundings of X and of the Grams' operands (≤ 0.01
# bits in float64 studies; docs/DESIGN.md, Certified truncation).
TILE_BOUND_MARGIN_LOG2 = 0.25
# A piece's warm-up must attenuate the state it drops by 2^TRUNCATION_LOG2 (``reference.kda_pieces``).
TRUNCATION_LOG2 = -20.0
# The most tiles a piece's walk looks back for that certificate (two warp rounds); one that finds
# none runs from its sequence's start.
WALK_TILES = 64


def tile_bound_grid(total_slots: int) -> dict:
    """The grid's ``bound_ctas`` per head."""
    return {"bound_ctas": -(-total_slots // TILE_BOUND_WARPS)}


@dataclasses.dataclass(frozen=True)
class TileBoundSpec(KernelSpec):
    """Per (tile slot, head) of a K1 workspace, log2 of a bound of the tile map's norm."""

    kernel: ClassVar[str] = "tile_bound"
    params: ClassVar[tuple] = TILE_BOUND_PARAMS
    grid: ClassVar[tuple] = ("bound_ctas", "heads", 1)
    block: ClassVar[tuple] = (32 * TILE_BOUND_WARPS, 1, 1)
