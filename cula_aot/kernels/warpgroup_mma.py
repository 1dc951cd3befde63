"""Warpgroup-level MMA for sm_90a as inline PTX: ``wgmma.mma_async`` with A from registers and B
from shared memory, its fence / commit / wait, and the shared-memory matrix descriptor.

Why: a warp's ``mma.sync`` B fragments come through its own ``ldmatrix`` reads, so four warps
that share an operand read it from shared memory four times; one ``wgmma`` of a warpgroup (4
consecutive warps, 128 threads) reads it once.

Layouts (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts"), with ``g = lane // 4``,
``t = lane % 4`` and warp ``w`` of the warpgroup owning rows ``16w .. 16w + 15`` of M = 64:

* A (m64 × k16, bf16): per warp the ``mma.m16n8k16`` A fragment (``warp_mma``), four b32
  registers.
* D (m64 × N, fp32): N / 2 values per thread; value ``4j + c`` is row ``g + 8·(c // 2)``, column
  ``8j + 2t + c % 2``: per warp the ``mma.m16n8`` C fragments of the N / 8 n-tiles in order, so a
  K2 warp's state registers are this D unchanged.
* B in shared memory, no swizzle ("interleave"): 8 × 16-byte core matrices (128 contiguous
  bytes). K-major (``transpose_b`` False): a core matrix is 8 N rows of 8 consecutive K values;
  the leading byte offset steps K, the stride byte offset steps N. N-major (True): a core
  matrix is 8 K rows of 8 consecutive N values; the leading offset steps K, the stride offset N.
"""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from .warp_mma import register_list, register_struct


def smem_descriptor(smem_address, leading_bytes: int, stride_bytes: int):
    """The 64-bit wgmma descriptor of a no-swizzle operand at a 32-bit shared address: start
    address, leading and stride byte offsets, each in 16-byte units."""
    low = ((cutlass.Int32(smem_address) >> 4) & cutlass.Int32(0x3FFF)) | cutlass.Int32((leading_bytes >> 4) << 16)
    return cutlass.Int64(low) | cutlass.Int64((stride_bytes >> 4) << 32)


def wgmma_fence() -> None:
    """Orders this thread's register writes before the next ``wgmma`` reads them."""
    llvm.inline_asm(None, [], "wgmma.fence.sync.aligned;", "", has_side_effects=True)


def wgmma_commit() -> None:
    """Closes the group of ``wgmma`` issued since the last commit."""
    llvm.inline_asm(None, [], "wgmma.commit_group.sync.aligned;", "", has_side_effects=True)


def wgmma_wait(pending: int, accumulators: list) -> list:
    """Waits until at most ``pending`` groups are in flight; the accumulators pass through, so no
    use of them can be scheduled before the wait."""
    count = len(accumulators)
    result = llvm.inline_asm(
        register_struct(count, T.f32()),
        [cutlass.Float32(x).ir_value() for x in accumulators],
        f"wgmma.wait_group.sync.aligned {pending};",
        ",".join(["=f"] * count + [str(i) for i in range(count)]),
        has_side_effects=True,
    )
    return [cutlass.Float32(llvm.extractvalue(T.f32(), result, [i])) for i in range(count)]


def wgmma_bf16(n: int, accumulators: list, a: list, b_descriptor, transpose_b: bool) -> list:
    """D += A·B, ``wgmma.mma_async.m64n{n}k16`` (bf16 in, fp32 accumulators in place): A four b32
    registers, B the descriptor. The result is in flight until ``wgmma_wait``."""
    count = n // 2
    assert len(accumulators) == count and len(a) == 4
    operands = [cutlass.Int32(x).ir_value() for x in a] + [cutlass.Int64(b_descriptor).ir_value()]
    operands += [cutlass.Int32(1).ir_value()]  # scale-d: accumulate
    operands += [cutlass.Float32(x).ir_value() for x in accumulators]
    result = llvm.inline_asm(
        register_struct(count, T.f32()),
        operands,
        f"{{ .reg .pred p; setp.ne.b32 p, ${count + 5}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {register_list(0, count)}, {register_list(count, 4)}, "
        f"${count + 4}, p, 1, 1, "
        f"{int(transpose_b)}; }}",
        ",".join(["=f"] * count + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(count)]),
        has_side_effects=True,
    )
    return [cutlass.Float32(llvm.extractvalue(T.f32(), result, [i])) for i in range(count)]
