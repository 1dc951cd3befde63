"""The intracard-CP merge (``kernels/cp_merge.py``): its parameters, column-block variants and their dispatch."""

import dataclasses
from typing import ClassVar

from .abi import KernelSpec, bound_params, pointer, scalar, state_params

MERGE_PARAMS = (
    pointer("initial_state", "f32"),
    pointer("prescan", "f32"),
    pointer("carries", "f32"),
    pointer("seq_segments", "i32"),
    pointer("state_indices", "i32"),
    scalar("num_seqs", "i32"),
    *state_params("init"),
    scalar("flags", "i32"),
    *bound_params("init"),
)
MERGE_V_BLOCKS = (8, 16)  # state columns per merge CTA, both built
MERGE_THREADS = 256  # eight warps, one m16 tile of the 128 state rows each


def merge_v_block(heads: int, num_seqs: int, sm_count: int) -> int:
    """The merge's column block: 8 while its grid of one-CTA-per-SM blocks still fits the SMs
    in one wave (twice the CTAs for the same chain), else 16."""
    narrow, wide = MERGE_V_BLOCKS
    return narrow if (128 // narrow) * heads * num_seqs <= sm_count else wide


@dataclasses.dataclass(frozen=True)
class MergeSpec(KernelSpec):
    """Intracard CP merge: one CTA per (state column block, head, sequence)."""

    kernel: ClassVar[str] = "cp_merge"
    params: ClassVar[tuple] = MERGE_PARAMS
    dependent_launch: ClassVar[bool] = True

    v_block: int = 16
    block: ClassVar[tuple] = (MERGE_THREADS, 1, 1)

    @property
    def grid(self) -> tuple:
        return (128 // self.v_block, "heads", "num_seqs")
