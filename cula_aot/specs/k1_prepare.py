"""K1 prepare (``kernels/k1_prepare.py``): its parameters, the variant, grid and the tiles each CTA walks."""

import dataclasses
from typing import ClassVar

from .abi import K1_INPUTS, SEQUENCE_SCALARS, TOKEN_SCALARS, WORKSPACE_POINTERS, KernelSpec, gate_field, pointer, scalar

K1_PARAMS = (
    *K1_INPUTS,
    pointer("cu_seqlens", "i32"),
    *WORKSPACE_POINTERS,
    *SEQUENCE_SCALARS,
    scalar("beta_row_stride", "i32"),
    scalar("tiles_per_cta", "i32"),
    *TOKEN_SCALARS,  # flags: the input conventions only
)


@dataclasses.dataclass(frozen=True)
class K1Spec(KernelSpec):
    """K1 prepare: one CTA per ``tiles_per_cta`` consecutive tile slots of one head."""

    kernel: ClassVar[str] = "k1_prepare"
    params: ClassVar[tuple] = K1_PARAMS
    static_args: ClassVar[tuple] = ("token_coords",)
    grid: ClassVar[tuple] = ("k1_ctas", "heads", 1)

    varlen: bool
    gate: str = gate_field()


# K1 CTAs resident per SM (registers), and the most tile slots one CTA walks: each CTA loads its
# next tiles while it computes one, so fewer, longer CTAs hide the load latency; the grid keeps
# K1_WAVES waves of resident CTAs so that it still spreads evenly over the SMs (one wave of
# 8-tile CTAs lost 4% on 32×256 H8; PERFORMANCE.md, K1 prepare).
K1_CTAS_PER_SM = 4
K1_MAX_TILES_PER_CTA = 8
K1_WAVES = 4


def k1_grid(total_slots: int, heads: int, sm_count: int) -> dict:
    """K1's launch values: ``tiles_per_cta`` (the fewest that fit all tiles into K1_WAVES waves
    of resident CTAs, at most K1_MAX_TILES_PER_CTA) and the grid's ``k1_ctas`` per head."""
    resident = K1_CTAS_PER_SM * sm_count * K1_WAVES
    tiles_per_cta = max(1, min(K1_MAX_TILES_PER_CTA, -(-(total_slots * heads) // resident)))
    return {"tiles_per_cta": tiles_per_cta, "k1_ctas": -(-total_slots // tiles_per_cta)}
