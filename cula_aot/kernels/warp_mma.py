"""Warp-level primitives for sm_80+ as inline PTX: tensor-core mma.sync m16n8k16, ldmatrix and the
16-byte cp.async that stages operands for it.

CuTe's TiledMma partitions fragments for whole tiles; K2 instead needs to reuse an fp32
accumulator fragment directly as the next product's bf16 A operand (the m16n8k16 C layout of
two adjacent n-tiles is exactly the A layout of one k-step), so it addresses fragment
registers itself.  Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
``g = lane // 4`` and ``t = lane % 4``:

* A (16×16, row major), four b32 registers of bf16 pairs: (g, 2t..2t+1), (g+8, 2t..),
  (g, 2t+8..), (g+8, 2t+8..).
* B (16×8, "col"), two registers: (k = 2t..2t+1, n = g), (k = 2t+8.., n = g).
* C/D (16×8 fp32), four values: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).

tf32 m16n8k8 (fp32 data rounded to tf32): A (16×8) a0..a3 at (g, t), (g+8, t), (g, t+4),
(g+8, t+4); B (8×8) b0, b1 at (k = t, n = g), (k = t+4, n = g); C/D as above.

``ldmatrix .x4`` loads four 8×8 b16 matrices; lanes 8m..8m+7 give the 16-byte row addresses
of matrix m and register m of lane l holds row l//4, columns 2(l%4)..+1 (transposed with
``.trans``).
"""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def register_struct(count: int, element):
    """The LLVM struct type of ``count`` registers an inline-asm statement returns."""
    return llvm.StructType.get_literal([element] * count)


def ldmatrix_x4(smem_address, transpose: bool = False) -> list:
    """Four b32 fragment registers from four 8×8 bf16 matrices at a 32-bit shared address."""
    shape = ".trans" if transpose else ""
    result = llvm.inline_asm(
        register_struct(4, T.i32()),
        [cutlass.Int32(smem_address).ir_value()],
        f"ldmatrix.sync.aligned.m8n8.x4{shape}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,
    )
    return [cutlass.Int32(llvm.extractvalue(T.i32(), result, [i])) for i in range(4)]


def register_list(first: int, count: int) -> str:
    """The inline-asm operand list ``{$first, …}`` of ``count`` consecutive operands."""
    return "{" + ",".join(f"${first + i}" for i in range(count)) + "}"


def _mma_f32_accumulate(shape_and_types: str, a: list, b: list, c: list) -> list:
    """One ``mma.sync.aligned.<shape_and_types>`` with the given A and B b32 registers and 4 fp32
    C/D registers."""
    operands = [x.ir_value() for x in a] + [x.ir_value() for x in b]
    operands += [cutlass.Float32(x).ir_value() for x in c]
    na, nb = len(a), len(b)
    result = llvm.inline_asm(
        register_struct(4, T.f32()),
        operands,
        f"mma.sync.aligned.{shape_and_types} {register_list(0, 4)}, {register_list(4, na)}, "
        f"{register_list(4 + na, nb)}, {register_list(4 + na + nb, 4)};",
        ",".join(["=f"] * 4 + ["r"] * (na + nb) + ["f"] * 4),
    )
    return [cutlass.Float32(llvm.extractvalue(T.f32(), result, [i])) for i in range(4)]


def mma_bf16_m16n8k16(a: list, b: list, c: list) -> list:
    """D = A·B + C on tensor cores: bf16 operands (4 + 2 b32 registers), fp32 accumulators (4)."""
    return _mma_f32_accumulate("m16n8k16.row.col.f32.bf16.bf16.f32", a, b, c)


def mma_f16_m16n8k16(a: list, b: list, c: list) -> list:
    """D = A·B + C on tensor cores: fp16 operands (4 + 2 b32 registers), fp32 accumulators (4)."""
    return _mma_f32_accumulate("m16n8k16.row.col.f32.f16.f16.f32", a, b, c)


def mma_tf32_m16n8k8(a: list, b: list, c: list) -> list:
    """D = A·B + C on tensor cores: tf32 operands (4 + 2 registers from ``to_tf32``), fp32 (4)."""
    return _mma_f32_accumulate("m16n8k8.row.col.f32.tf32.tf32.f32", a, b, c)


def mma_tf32_m16n8k4(a: list, b: list, c: list) -> list:
    """D = A·B + C on tensor cores, k = 4: A (16×4) a0, a1 at (g, t), (g+8, t); B (4×8) b0 at
    (k = t, n = g); C/D as above."""
    return _mma_f32_accumulate("m16n8k4.row.col.f32.tf32.tf32.f32", a, b, c)


def to_tf32(x):
    """fp32 rounded to nearest tf32 (10-bit mantissa), as the b32 register an MMA operand takes."""
    return cutlass.Int32(llvm.inline_asm(T.i32(), [cutlass.Float32(x).ir_value()], "cvt.rna.tf32.f32 $0, $1;", "=r,f"))


def tf32_ready(x):
    """fp32 ``x`` with half a tf32 ulp added to its bits, kept as fp32: the MMA ignores the low 13
    bits, so this operand rounds to nearest (ties away) as ``to_tf32`` does for finite values, at
    one integer add per stored element instead of a conversion per fragment load (``f32_bits``)."""
    bits = cutlass.Int32(llvm.bitcast(T.i32(), cutlass.Float32(x).ir_value())) + cutlass.Int32(0x1000)
    return cutlass.Float32(llvm.bitcast(T.f32(), bits.ir_value()))


def f32_bits(x):
    """The b32 register of an fp32 value (an MMA operand stored with ``tf32_ready``)."""
    return cutlass.Int32(llvm.bitcast(T.i32(), cutlass.Float32(x).ir_value()))


def tf32_split(x) -> tuple:
    """(hi, lo) tf32 registers with hi + lo = x to ~2^-21 relative: three tf32 MMAs
    (lo·hi + hi·lo + hi·hi) then multiply with nearly fp32 accuracy ("3xTF32").  hi is x rounded
    to nearest tf32 by integer ops (half an ulp added to the bits, the low 13 cleared); lo = x − hi
    is exact in fp32 and goes in as is: the MMA truncates it to tf32, an error of at most 2^-10·|lo|
    ≤ 2^-21·|x|.  Three instructions, where ``to_tf32`` twice and a subtract are seven."""
    hi_bits = f32_bits(tf32_ready(x)) & cutlass.Int32(-0x2000)
    lo = cutlass.Float32(x) - cutlass.Float32(llvm.bitcast(T.f32(), hi_bits.ir_value()))
    return hi_bits, f32_bits(lo)


def _pack_x2(kind: str, low, high):
    """Two fp32 values rounded to nearest ``kind`` (bf16, f16) in one b32 register, ``low`` in
    the low half."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(),
            [cutlass.Float32(high).ir_value(), cutlass.Float32(low).ir_value()],
            f"cvt.rn.{kind}x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )


def pack_bf16x2(low, high):
    """Two fp32 values rounded to nearest bf16 in one b32 register, ``low`` in the low half."""
    return _pack_x2("bf16", low, high)


def pack_f16x2(low, high):
    """Two fp32 values rounded to nearest fp16 in one b32 register, ``low`` in the low half."""
    return _pack_x2("f16", low, high)


def movmatrix_trans(register):
    """The transpose of the 8×8 b16 matrix whose row lane // 4, columns 2·(lane % 4) + {0, 1} is
    each lane's ``register`` (the mma C layout), in the same layout."""
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(), [cutlass.Int32(register).ir_value()], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r"
        )
    )


def bf16_as_f32(pair, high: bool):
    """The low or high bf16 of a b32 register, widened (exactly) to fp32."""
    bits = pair & cutlass.Int32(-65536) if high else pair << 16
    return cutlass.Float32(llvm.bitcast(T.f32(), cutlass.Int32(bits).ir_value()))


def accumulators_as_a(acc, first: int) -> list:
    """The A fragment of one k-step from the accumulators of two adjacent n-tiles.

    ``acc`` holds n-tile j's C fragment at ``acc[4j .. 4j+3]``; ``first`` is the index of the
    lower n-tile's first value.  Values are rounded to bf16.
    """
    return [
        pack_bf16x2(acc[first + 0], acc[first + 1]),
        pack_bf16x2(acc[first + 2], acc[first + 3]),
        pack_bf16x2(acc[first + 4], acc[first + 5]),
        pack_bf16x2(acc[first + 6], acc[first + 7]),
    ]


def opaque_i32(value):
    """``value`` through a volatile ``mov``: what is computed from it stays where it is used.  A
    store inside a loop (a checkpoint write in the tile loop) otherwise has its loop-invariant
    addresses hoisted out of the loop and kept live through it (spills)."""
    return cutlass.Int32(
        llvm.inline_asm(T.i32(), [cutlass.Int32(value).ir_value()], "mov.b32 $0, $1;", "=r,r", has_side_effects=True)
    )


def cp_async_16(smem_address, global_address, src_bytes):
    """Copy 16 bytes global→shared asynchronously (L2 only); bytes past ``src_bytes`` (0 or 16)
    are zero-filled.  Complete with ``cute.arch.cp_async_commit_group`` / ``cp_async_wait_group``."""
    llvm.inline_asm(
        None,
        [
            cutlass.Int32(smem_address).ir_value(),
            cutlass.Int64(global_address).ir_value(),
            cutlass.Int32(src_bytes).ir_value(),
        ],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
    )


def stmatrix_x4_trans(smem_address, registers: list) -> None:
    """Store four 8×8 bf16 matrices, each lane's b32 fragment register per matrix (the mma C
    layout: row lane // 4, columns 2·(lane % 4) + {0, 1}), transposed: lanes 8m..8m+7 give the
    32-bit shared addresses of matrix m's stored rows (its columns), 16 bytes each."""
    _store_b32("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16", cutlass.Int32(smem_address), registers)


def _load_v4(instruction: str, address, element) -> list:
    """``instruction {4 registers}, [address];`` as inline PTX: four b32 words (``element``
    ``cutlass.Int32``) or fp32 values (``cutlass.Float32``) from a 32-bit shared (``Int32``) or
    64-bit global (``Int64``) address."""
    f32 = element is cutlass.Float32
    ir_type = T.f32() if f32 else T.i32()
    result = llvm.inline_asm(
        register_struct(4, ir_type),
        [address.ir_value()],
        f"{instruction} {{$0,$1,$2,$3}}, [$4];",
        ",".join(["=f" if f32 else "=r"] * 4 + ["l" if isinstance(address, cutlass.Int64) else "r"]),
        has_side_effects=True,
    )
    return [element(llvm.extractvalue(ir_type, result, [i])) for i in range(4)]


def ld_shared_v4(smem_address) -> list:
    """Four b32 words (16 bytes) from a 16-byte-aligned 32-bit shared address."""
    return _load_v4("ld.shared.v4.b32", cutlass.Int32(smem_address), cutlass.Int32)


def ld_cluster_f32(cluster_address):
    """One fp32 from a 32-bit ``shared::cluster`` address (``cute.arch.map_dsmem_ptr(...).toint()``:
    another CTA's shared memory in this cluster)."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Int32(cluster_address).ir_value()],
            "ld.shared::cluster.f32 $0, [$1];",
            "=f,r",
            has_side_effects=True,
        )
    )


def st_global_v4(global_address, words: list) -> None:
    """Store four b32 words (16 bytes) at a 16-byte-aligned global address."""
    _store_b32("st.global.v4.b32", cutlass.Int64(global_address), words)


def st_global_v4_f32(global_address, values: list) -> None:
    """Store four fp32 values (16 bytes) at a 16-byte-aligned global address."""
    _store_b32("st.global.v4.f32", cutlass.Int64(global_address), values, cutlass.Float32)


def ld_global_cg_v4_f32(global_address) -> list:
    """Four fp32 values (16 bytes) from a 16-byte-aligned global address, cached in L2 only (another
    SM may have written them during this kernel: L1 is not coherent)."""
    return _load_v4("ld.global.cg.v4.f32", cutlass.Int64(global_address), cutlass.Float32)


def _store_b32(instruction: str, address, words: list, element=cutlass.Int32) -> None:
    """``instruction [address], {words};`` as inline PTX, ``address`` a 32-bit shared (``Int32``)
    or 64-bit global (``Int64``) address, the words b32 (``element`` ``cutlass.Int32``) or fp32
    (``cutlass.Float32``): the stores differ only in those and the opcode.  No results, so
    ``has_side_effects`` keeps each store, in program order."""
    llvm.inline_asm(
        None,
        [address.ir_value(), *(element(w).ir_value() for w in words)],
        f"{instruction} [$0], {register_list(1, len(words))};",
        ",".join(
            ["l" if isinstance(address, cutlass.Int64) else "r"]
            + ["f" if element is cutlass.Float32 else "r"] * len(words)
        ),
        has_side_effects=True,
    )
