"""Tile bound: per (tile slot, head), log2 of a sound bound of the Frobenius norm of the map the
tile applies to the state it receives, from K1's workspace record (docs/DESIGN.md, Certified
truncation; ``reference.tile_decay_bound``'s Frobenius part in the triangle form).

The tile map is ``A = diag(gtot) − krᵀ·X`` with ``X = INV·diag(b)·kd`` (16 tokens × 128 keys), and

    ‖A‖₂ ≤ ‖A‖_F ≤ ‖gtot‖ + ‖krᵀ·X‖_F,   ‖krᵀ·X‖_F² = ⟨kr·krᵀ, X·Xᵀ⟩

(two 16×16 Gram matrices: no 128×128 product).  It is formed from the record's own values (bf16
kd, kr and INV, fp32 gt and b), so it bounds the map K2 applies; X and the Grams' operands are
rounded to bf16 on the way, which ``MARGIN_LOG2`` covers.

One warp per (slot, head), all on tensor cores (``mma.sync.m16n8k16``), per 16-key block:
Xᵀ = (kdᵀ·diag(b))·INVᵀ exactly as K2 forms Uᵀ = Wᵀ·INVᵀ (``tile_chain.tile_u``), with kdᵀ read
as K2 reads kr (``ldmatrix.trans``: its B fragments are Wᵀ's accumulator pairs); X·Xᵀ from Xᵀ's
fragments transposed in registers (``movmatrix``), kr·krᵀ from one ``ldmatrix`` of the kr image
(the B fragments of krᵀ, regrouped as the A fragment of kr).  The two Grams meet elementwise in
the same accumulator layout, then across the warp by shuffles.  The record's first
``PRESCAN_RECORD_BYTES`` (kd, kr, inv, gt, b) are staged with 16-byte ``cp.async``.

Launch: grid (ceil(total_slots / 4), H, 1), block (128, 1, 1) (four warps, a slot each),
``SMEM_BYTES`` dynamic shared memory.  Slots in varlen gaps (never written by K1) give garbage
bounds, which no walk reads: a walk stays inside its sequence.
"""

import math
from typing import Callable, NamedTuple

import cutlass
import cutlass.cute as cute

from ..layout import PRESCAN_RECORD_BYTES, WORKSPACE_PART_OFFSETS, WORKSPACE_RECORD_BYTES
from ..specs import TILE_BOUND_MARGIN_LOG2 as MARGIN_LOG2
from ..specs import TILE_BOUND_WARPS as WARPS
from ..specs import TRUNCATION_LOG2, WALK_TILES
from .common import CHUNK, D, TRACE_HEADS, record_part
from .tile_chain import image_lane_offset, image_trans_lane_offset, square_lane_offset, tile_u
from .warp_mma import bf16_as_f32, cp_async_16, ldmatrix_x4, mma_bf16_m16n8k16, movmatrix_trans

THREADS = 32 * WARPS
SMEM_BYTES = WARPS * PRESCAN_RECORD_BYTES
KEY_BLOCKS = D // 16
IMAGE_K_STEP_BYTES = 2 * CHUNK * 16  # a 16-key block of a K_INTER image
_COPY_CHUNKS = PRESCAN_RECORD_BYTES // 16

assert PRESCAN_RECORD_BYTES % 16 == 0 and all(
    WORKSPACE_PART_OFFSETS[p] < PRESCAN_RECORD_BYTES for p in ("kd", "kr", "inv", "gt", "b")
)


class RecordImages(NamedTuple):
    """Where a tile record's images lie (trace-time constants): the byte offsets of kd, kr and INV
    from the record's base, the bytes from one 16-key block of an image to the next, and a lane's
    ``ldmatrix`` row offset in key block 0 (``lane_offset``: token blocks × key blocks;
    ``trans_lane_offset``: the transposed read)."""

    kd: int
    kr: int
    inv: int
    key_block_bytes: int
    lane_offset: Callable
    trans_lane_offset: Callable


# K1's workspace record (K_INTER images).
WORKSPACE_IMAGES = RecordImages(
    WORKSPACE_PART_OFFSETS["kd"],
    WORKSPACE_PART_OFFSETS["kr"],
    WORKSPACE_PART_OFFSETS["inv"],
    IMAGE_K_STEP_BYTES,
    image_lane_offset,
    image_trans_lane_offset,
)


def w_register(n_tile: int, half: int) -> int:
    """Which of the kd ``ldmatrix.trans`` registers holds Wᵀ's pairs for token n-tile ``n_tile``
    and key half ``half`` (registers 0, 1: key n-tile 2·block; 2, 3: 2·block + 1; each pair b0
    (tokens 2t, 2t + 1) then b1 (tokens 8 + 2t, 9 + 2t))."""
    return 2 * half + n_tile


def x_operands(xt: list, transpose) -> tuple:
    """From Xᵀ's A fragment ``xt`` (keys × tokens: 8×8 blocks keys 0-7 / 8-15 × tokens 0-7, then
    × tokens 8-15) and an 8×8 register ``transpose``: X's A fragment (tokens × keys) and Xᵀ's B
    fragment (keys × tokens) per token n-tile."""
    x00, x01, x10, x11 = (transpose(r) for r in xt)  # x<token block><key block>
    return [x00, x10, x01, x11], ([x00, x01], [x10, x11])


def kr_a_operand(kr_b: list) -> list:
    """kr's A fragment (tokens × keys) from the ``ldmatrix`` registers that are krᵀ's B fragments
    (keys × tokens) of token n-tiles 0 and 1."""
    return [kr_b[0], kr_b[2], kr_b[1], kr_b[3]]


@cute.jit
def frobenius_log2(base, b_rows: cute.Tensor, gt: cute.Tensor, lane, images: RecordImages):
    """log2 of ``‖gtot‖ + ‖krᵀ·X‖_F`` plus ``MARGIN_LOG2`` for the record at 32-bit shared address
    ``base`` (its images where ``images`` says; ``b_rows``, ``gt``: its b and gt parts), computed
    by one warp; every lane returns it."""
    t = lane % 4
    trans_lane = images.trans_lane_offset(lane)
    image_lane = images.lane_offset(lane)
    square_lane = square_lane_offset(lane)
    gram_x = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    gram_kr = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
    gram_x.fill(0.0)
    gram_kr.fill(0.0)
    for block in cutlass.range_constexpr(KEY_BLOCKS):
        # Wᵀ = kdᵀ·diag(b) for keys 16·block .. + 15 (accumulator layout: key rows, token columns).
        kd_pairs = ldmatrix_x4(base + images.kd + block * images.key_block_bytes + trans_lane, transpose=True)
        w = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        for i in cutlass.range_constexpr(8):
            n_tile, half, column = i // 4, (i // 2) % 2, i % 2
            kd_value = bf16_as_f32(kd_pairs[w_register(n_tile, half)], column == 1)
            w[i] = kd_value * b_rows[8 * n_tile + 2 * t + column]
        # Xᵀ (keys × tokens) as an A fragment: four 8×8 blocks (keys 0-7 / 8-15 × tokens 0-7 / 8-15).
        xt = tile_u(w, base, images.inv, square_lane)
        # Their transposes are X's blocks: A of X (tokens × keys) and B of Xᵀ (keys × tokens).
        a_x, b_x = x_operands(xt, movmatrix_trans)
        for n in cutlass.range_constexpr(2):
            d = mma_bf16_m16n8k16(a_x, b_x[n], [gram_x[4 * n + c] for c in range(4)])
            for c in cutlass.range_constexpr(4):
                gram_x[4 * n + c] = d[c]
        # krᵀ's B fragments per token n-tile (keys × tokens); regrouped, kr's A fragment.
        kr_b = ldmatrix_x4(base + images.kr + block * images.key_block_bytes + image_lane)
        a_kr = kr_a_operand(kr_b)
        for n in cutlass.range_constexpr(2):
            d = mma_bf16_m16n8k16(a_kr, kr_b[2 * n : 2 * n + 2], [gram_kr[4 * n + c] for c in range(4)])
            for c in cutlass.range_constexpr(4):
                gram_kr[4 * n + c] = d[c]
    inner = cutlass.Float32(0.0)
    for i in cutlass.range_constexpr(8):
        inner = inner + gram_kr[i] * gram_x[i]
    diagonal = cutlass.Float32(0.0)
    for j in cutlass.range_constexpr(D // 32):
        value = gt[lane * (D // 32) + j]
        diagonal = diagonal + value * value
    for b in cutlass.range_constexpr(5):
        inner = inner + cute.arch.shuffle_sync_bfly(inner, offset=1 << b)
        diagonal = diagonal + cute.arch.shuffle_sync_bfly(diagonal, offset=1 << b)
    norm = cute.math.sqrt(diagonal) + cute.math.sqrt(cutlass.max(inner, cutlass.Float32(0.0)))
    return cute.math.log2(norm) + cutlass.Float32(MARGIN_LOG2)


@cute.jit
def certified_warmup(bounds: cute.Pointer, c0, lane):
    """The tiles a piece starting at tile ``c0`` of its sequence walks back: the fewest whose
    bounds (``bounds`` points at the piece's first tile's; those before it precede it) sum to
    ≤ ``TRUNCATION_LOG2``, or ``c0`` (its sequence's start) when none within ``min(c0,
    WALK_TILES)`` does.  One warp: a shuffle prefix sum per 32 tiles and a ballot for the first
    that certifies (a NaN sum never does); every lane returns it."""
    walked = cutlass.Int32(c0)
    acc = cutlass.Float32(0.0)
    found = cutlass.Boolean(False)
    for round in cutlass.range_constexpr(WALK_TILES // 32):
        back = round * 32 + lane + 1
        value = cutlass.Float32(0.0)
        if back <= c0:
            value = cute.make_tensor(bounds - back, cute.make_layout(1))[0]
        for b in cutlass.range_constexpr(5):
            below = cute.arch.shuffle_sync_up(value, offset=1 << b)
            if lane >= (1 << b):
                value = value + below
        hit = cute.arch.vote_ballot_sync((acc + value <= cutlass.Float32(TRUNCATION_LOG2)) & (back <= c0))
        if hit != 0:
            if not found:
                walked = cutlass.Int32(round * 32 + 1) + cutlass.Int32(cute.arch.clz(cute.arch.brev(hit)))
                found = cutlass.Boolean(True)
        acc = acc + cute.arch.shuffle_sync(value, offset=31)
    return walked


class TileBound:
    """The tile bound over every slot of a K1 workspace (``specs.TileBoundSpec``): compile-time
    configuration here (none), the launch in ``__call__``, the device code in ``kernel``."""

    def __init__(self):
        pass  # no codegen arguments: one build serves every workspace

    def __str__(self) -> str:
        return "kernel"

    @cute.jit
    def __call__(self, *params, stream):
        # ``params``: the kernel's runtime parameters (``specs.TILE_BOUND_PARAMS``); the grid is a
        # placeholder (the runtime launches the spec's).
        self.kernel(*params).launch(grid=[1, TRACE_HEADS, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream)

    @cute.kernel
    def tile_bound(self, workspace: cute.Pointer, bounds: cute.Pointer, total_slots: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, head, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        slot = cta * WARPS + warp
        smem = cutlass.utils.SmemAllocator()
        s_records = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(SMEM_BYTES), 128)
        stage = s_records.iterator + warp * PRESCAN_RECORD_BYTES
        if slot < total_slots:
            slot_index = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(slot)
            record = workspace + cute.assume(slot_index * WORKSPACE_RECORD_BYTES, divby=16)
            for j in cutlass.range_constexpr(math.ceil(_COPY_CHUNKS / 32)):
                chunk = lane + 32 * j
                if chunk < _COPY_CHUNKS:
                    cp_async_16((stage + chunk * 16).toint(), (record + chunk * 16).toint(), 16)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            b_rows = cute.make_tensor(record_part(stage, "b", cutlass.Float32), cute.make_layout(CHUNK))
            gt = cute.make_tensor(record_part(stage, "gt", cutlass.Float32), cute.make_layout(D))
            value = frobenius_log2(stage.toint(), b_rows, gt, lane, WORKSPACE_IMAGES)
            if lane == 0:
                cute.make_tensor(bounds + slot_index, cute.make_layout(1))[0] = value

    kernel = tile_bound
