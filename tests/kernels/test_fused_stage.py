"""The fused prefill's stage layout (``kernels/fused_prefill.py``): the producers' image row
stores are bank-conflict-free, the images are wgmma no-swizzle operands (16-byte rows of 8-row
core matrices at the descriptor strides), and the parts fit their stage.  Needs CuTeDSL (the
kernel module imports it)."""

import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import fused_prefill as fused  # noqa: E402
from cula_aot.kernels import prepare_tile as k1  # noqa: E402
from cula_aot.layout import CHUNK, D  # noqa: E402


def test_producer_row_stores_hit_eight_bank_groups_per_phase():
    # A 16-byte store is served in phases of 8 lanes; each lane stores 8 columns of one row.
    for warp in range(k1.WARPS):
        for half in range(2):
            for phase in range(4):
                groups = set()
                for lane in range(8 * phase, 8 * phase + 8):
                    row = k1.lane_rows(lane)[half]
                    groups.add(fused.stage_image_offset(row, k1.lane_columns(warp, lane)) // 16 % 8)
                assert len(groups) == 8, (warp, half, phase)


def test_stage_images_are_core_matrices_at_the_descriptor_strides():
    seen = set()
    for row in range(CHUNK):
        for col in range(D):
            at = fused.stage_image_offset(row, col)
            core = (col // 8) * fused.STAGE_KEY_GROUP_BYTES + (row // 8) * fused.STAGE_TOKEN_HALF_BYTES
            assert at == core + (row % 8) * 16 + (col % 8) * 2
            seen.add(at)
    assert len(seen) == CHUNK * D and max(seen) < fused.STAGE_IMAGE_BYTES
    assert fused.STAGE_K_STEP_UNITS * 16 == 2 * fused.STAGE_KEY_GROUP_BYTES  # 16 keys per k-step
    assert all(b % 16 == 0 for b in (fused.STAGE_KEY_GROUP_BYTES, fused.STAGE_TOKEN_HALF_BYTES))


def test_stage_parts_are_disjoint_aligned_and_fill_the_stage():
    spans = sorted((fused.STAGE_PART_OFFSETS[p], fused.STAGE_PART_BYTES[p]) for p in fused.STAGE_PART_BYTES)
    end = 0
    for offset, size in spans:
        assert offset == end and offset % 32 == 0
        end = offset + size
    assert end == fused.STAGE_BYTES
    assert fused.smem_bytes(4, 2) <= 227 * 1024
