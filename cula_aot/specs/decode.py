"""Decode (``kernels/decode.py``, the token kernel, and ``kernels/decode_chunk.py``, the tensor-core
chunk kernel): their shared parameter list, variants, shared memory, grids and the dispatch
that picks one per call from N·H, T and the pool."""

import dataclasses
from typing import ClassVar

from ..gates import DEFAULT_GATE
from .abi import GATES, STATUS_POINTER, TOKEN_SCALARS, KernelSpec, gate_field, pointer, scalar

DECODE_MAX_TOKENS = 8  # tokens per sequence and call (speculative decoding verifies several)
DECODE_FLAG_INTERMEDIATE = 1  # ``flags`` bit: write the state after every token
DECODE_FLAG_STATUS = 2  # ``flags`` bit: a status word is given (``layout.STATUS_SLOT_OUT_OF_RANGE``)
# ``flags`` bits of vLLM's speculative contract: state_indices is [N, T] and the state after token
# t goes to slot state_indices[n, t]; the state read is column 0, or with num_accepted column
# num_accepted[n] − 1 (the slot holding the state after the last call's accepted tokens).
DECODE_FLAG_TOKEN_SLOTS = 4
DECODE_FLAG_ACCEPTED = 8
# and the input conventions' bits, shared with K1 (``layout.FLAG_BETA_PROBABILITY``, ``FLAG_QK_AS_GIVEN``)
# (V rows per item, items per CTA) of the built decode kernels: one warp per 16 rows; with
# several items a CTA walks V blocks of one head, the next one's state streaming into shared
# memory while the current one computes.  Only what ``pick_variant`` (below) launches is
# built: 16-row items and 64-row single items lost on every row of the first sweep, 64-row pairs
# on a later sweep (docs/PERFORMANCE.md, Decode).
DECODE_VARIANTS = ((32, 1), (32, 2), (32, 4))

# The tensors the decode kernels and the fused layer take first: the token inputs, the gate
# parameters, the slot indices and the pool.
STEP_TENSORS = (
    pointer("q", "bf16"),
    pointer("k", "bf16"),
    pointer("v", "bf16"),
    pointer("g", "bf16"),
    pointer("beta", "bf16"),  # rounded down to 16 bytes; beta_offset elements added on device
    pointer("a_log", "f32"),
    pointer("dt_bias", "f32"),
    pointer("state_indices", "i32"),  # rounded down to 16 bytes; index_offset added on device
    pointer("state_pool", "state"),  # element dtype: f32 or bf16 by spec (see DecodeSpec.params)
)
# Both decode kernels' parameters, in three runs that they take as parameter groups
# (``kernels.params``): the tensors (``DecodeTensors``), their sizes, strides and offsets
# (``DecodeGeometry``), and ``TOKEN_SCALARS`` (``TokenScalars``).
DECODE_TENSORS = (
    *STEP_TENSORS,
    pointer("intermediate", "state"),
    pointer("out", "bf16"),
    STATUS_POINTER,
    pointer("num_accepted", "i32", address_align=4),  # [N], with DECODE_FLAG_ACCEPTED
)
DECODE_GEOMETRY = (
    scalar("num_seqs", "i32"),
    scalar("num_tokens", "i32"),
    scalar("num_slots", "i32"),
    scalar("slot_stride", "i32"),
    *(scalar(f"{name}_stride_{axis}", "i32") for name in ("q", "k", "v", "g", "beta") for axis in ("n", "t")),
    scalar("beta_offset", "i32", per_call=True),  # where beta and state_indices start: the call's addresses
    scalar("index_offset", "i32", per_call=True),
    scalar("out_stride_n", "i32"),
    scalar("out_stride_t", "i32"),
)
DECODE_PARAMS = (*DECODE_TENSORS, *DECODE_GEOMETRY, *TOKEN_SCALARS)


def with_state_dtype(params: tuple, state_dtype: str) -> tuple:
    """``params`` with the state pointers (dtype "state": the pool, the intermediate states) of
    element dtype ``state_dtype``."""
    return tuple(dataclasses.replace(p, dtype=state_dtype) if p.dtype == "state" else p for p in params)


def decode_params(state_dtype: str) -> tuple:
    """``DECODE_PARAMS`` with the pool and intermediate pointers of element dtype ``state_dtype``."""
    return with_state_dtype(DECODE_PARAMS, state_dtype)


def decode_threads(v_block: int) -> int:
    """Threads per decode CTA: one warp per 16 V rows."""
    return 32 * (v_block // 16)


def decode_stage_bytes(v_block: int, items: int, bf16_state: bool) -> int:
    """A decode CTA's stage for the next item's state (``v_block`` rows of 128 keys in the pool
    dtype, refilled item by item), or a placeholder when the CTA has one item."""
    return v_block * 128 * (2 if bf16_state else 4) if items > 1 else 128


def decode_token_bytes(v_block: int, items: int) -> int:
    """A decode CTA's shared memory per token: the four fp32 key vectors (α then k̂/A, k̂ then
    A⊙k̂, q̂ then A⊙q̂, A) and the bf16 v and o rows of its ``items·v_block`` rows."""
    return 4 * 128 * 4 + 2 * items * v_block * 2


def decode_smem_bytes(v_block: int, items: int, bf16_state: bool, tokens: int = DECODE_MAX_TOKENS) -> int:
    """Dynamic shared memory of a decode CTA (``kernels/decode.py``) for calls of ``tokens`` tokens:
    the stage, k̂·q̂ and b, alignment slack, and ``tokens`` times the per-token arrays.  The kernel
    is built for ``DECODE_MAX_TOKENS``; a launch asks for what its T uses, so short calls fit more
    CTAs per SM."""
    return (
        decode_stage_bytes(v_block, items, bf16_state)
        + 2 * DECODE_MAX_TOKENS * 4
        + 256
        + tokens * decode_token_bytes(v_block, items)
    )


@dataclasses.dataclass(frozen=True)
class TokenStepSpec(KernelSpec):
    """A kernel of the token step on a state pool (decode's token kernel, the fused layer): one CTA
    per (``items`` blocks of ``v_block`` V rows, head, sequence); the state of sequence n is
    ``state_pool[state_indices[n]]``, ``[V, K]`` per head (``kv_layout=False``) or ``[K, V]``,
    fp32 or bf16 (``bf16_state``)."""

    # The parameter list, its state pointers of element dtype "state" (``params``: the spec's).
    declared_params: ClassVar[tuple]

    kv_layout: bool
    bf16_state: bool
    v_block: int
    items: int = 1
    gate: str = gate_field()

    @classmethod
    def every(cls, variants) -> list:
        """One spec per gate, state layout, pool dtype and (v_block, items) of ``variants``."""
        return [
            cls(kv_layout=kv, bf16_state=bf16, v_block=vb, items=items, gate=gate)
            for gate in GATES
            for kv in (False, True)
            for bf16 in (False, True)
            for vb, items in variants
        ]

    @property
    def params(self) -> tuple:
        return with_state_dtype(self.declared_params, "bf16" if self.bf16_state else "f32")

    @property
    def ctas_per_head(self) -> int:
        return 128 // (self.items * self.v_block)

    @property
    def grid(self) -> tuple:
        return (self.ctas_per_head, "heads", "num_seqs")

    @property
    def block(self) -> tuple:
        return (decode_threads(self.v_block), 1, 1)


@dataclasses.dataclass(frozen=True)
class DecodeSpec(TokenStepSpec):
    """KDA decode (``kernels/decode.py``)."""

    kernel: ClassVar[str] = "kda_decode"
    declared_params: ClassVar[tuple] = DECODE_PARAMS

    def launch_smem_bytes(self, tokens: int) -> int:
        """Dynamic shared memory a launch for ``tokens`` tokens needs (≤ the built maximum)."""
        return decode_smem_bytes(self.v_block, self.items, self.bf16_state, tokens)


# The tensor-core form of 2–4 decode tokens on bf16 "vk" pools (``kernels/decode_chunk.py``);
# warps per CTA, each warp 16 V rows of one head.
DECODE_CHUNK_MAX_TOKENS = 4
DECODE_CHUNK_VARIANTS = ((4, 1), (4, 2), (2, 4))  # (warps, items)


def decode_chunk_stage_bytes(warps: int, items: int) -> int:
    """A chunk CTA's stage for the next item's state (its 16·warps rows in bf16), or a placeholder."""
    return warps * 16 * 128 * 2 if items > 1 else 16


def decode_chunk_smem_bytes(warps: int, items: int) -> int:
    """Dynamic shared memory of a chunk decode CTA: the per-token key vectors (α / ki, kd and qd,
    A: four fp32 [4, 128]), P's bf16 hi / lo operands, K̃, G and the dot products, k̂·q̂ and b,
    the warps' bf16 o staging, the next item's stage, and alignment slack."""
    tokens = DECODE_CHUNK_MAX_TOKENS
    return (
        4 * tokens * 128 * 4
        + 2 * 2 * tokens * 128 * 2
        + tokens * 128 * 4
        + (64 + 8 * tokens + 16 + 2 * tokens) * 4
        + warps * tokens * 16 * 2
        + decode_chunk_stage_bytes(warps, items)
        + 256
    )


@dataclasses.dataclass(frozen=True)
class DecodeChunkSpec(KernelSpec):
    """KDA decode of 2–4 tokens on a bf16 pool with keys contiguous, on tensor cores: one CTA per
    (``items`` blocks of 16·warps V rows, head, sequence), the next block's state streaming into
    shared memory while the current one computes; same parameter list as ``DecodeSpec``."""

    kernel: ClassVar[str] = "kda_decode_chunk"

    warps: int
    items: int = 1
    gate: str = gate_field()

    @property
    def params(self) -> tuple:
        return decode_params("bf16")

    @property
    def grid(self) -> tuple:
        return (128 // (16 * self.warps * self.items), "heads", "num_seqs")

    @property
    def block(self) -> tuple:
        return (32 * self.warps, 1, 1)

    def launch_smem_bytes(self, tokens: int) -> int:
        return decode_chunk_smem_bytes(self.warps, self.items)


def decode_specs() -> list[KernelSpec]:
    """Every decode specialization (both layouts, both pool dtypes, every ``DECODE_VARIANTS``, every
    gate; the chunk form for every ``DECODE_CHUNK_VARIANTS`` and gate)."""
    return DecodeSpec.every(DECODE_VARIANTS) + [
        DecodeChunkSpec(warps=w, items=i, gate=gate) for gate in GATES for w, i in DECODE_CHUNK_VARIANTS
    ]


# N·H thresholds of pick_variant.
DECODE_PAIRED_MIN_HEADS = 256
DECODE_STREAMING_MIN_HEADS = 1024  # bf16 T > 1: four items per CTA from here
DECODE_LARGE_HEADS = 2048
# N·H thresholds of the chunk kernel's CTA shape: one 64-row item below the first, a whole head
# streamed as four 32-row items (one wave of resident CTAs) up to the second, two 64-row items above.
DECODE_CHUNK_STREAMING_MIN_HEADS = 512
DECODE_CHUNK_PAIRED_MIN_HEADS = 8192


def chunk_applies(tokens: int, bf16_state: bool, state_layout: str, intermediates: bool) -> bool:
    """The tensor-core chunk kernel serves 2–4 tokens (any gate) on a bf16 "vk" pool without
    intermediate states or per-token slots (``intermediates``; ``kernels/decode_chunk.py``)."""
    return bf16_state and state_layout == "vk" and not intermediates and 2 <= tokens <= DECODE_CHUNK_MAX_TOKENS


def pick_variant(
    num_seqs: int,
    heads: int,
    tokens: int,
    bf16_state: bool,
    state_layout: str = "vk",
    intermediates: bool = False,
    gate: str = DEFAULT_GATE,
) -> tuple:
    """The kernel to launch: ``("chunk", warps, items)`` for the tensor-core chunk kernel, else the
    token kernel's (v_block, items); chosen from every variant timed per row on an H200
    (docs/PERFORMANCE.md, Decode):

    * bf16 pools, 2–4 tokens, "vk", no intermediates: the chunk kernel (measured 2026-12-02). N·H < 512:
      one 64-row item per CTA (the most CTAs); up to 8192: a whole head per CTA as four 32-row
      items, the next one streaming in while the current one computes (at N·H = 1024 every CTA
      is resident at once: 23.5 µs against 26.2 for two 64-row items, whose 1.6 waves leave a
      tail); from 8192 two 64-row items (1–2% faster there);
    * N·H < 256: one 32-row item per CTA (the most CTAs; latency-bound sizes);
    * bf16 pools: two 32-row items per CTA (the second streams into shared memory while the
      first computes), and for T > 1 from N·H = 1024 four (a whole head per CTA, the next item
      always in flight): 3-5% faster at T = 4;
    * fp32 pools: single items, except T = 1 from N·H = 2048, where pairs are 1% faster.

    16-row items and 64-row single items or pairs lost everywhere: none is built."""
    nh = num_seqs * heads
    if chunk_applies(tokens, bf16_state, state_layout, intermediates):
        if nh < DECODE_CHUNK_STREAMING_MIN_HEADS:
            return ("chunk", 4, 1)
        return ("chunk", 4, 2) if nh >= DECODE_CHUNK_PAIRED_MIN_HEADS else ("chunk", 2, 4)
    if nh < DECODE_PAIRED_MIN_HEADS:
        return 32, 1
    if bf16_state:
        return (32, 4) if tokens > 1 and nh >= DECODE_STREAMING_MIN_HEADS else (32, 2)
    return (32, 2) if tokens == 1 and nh >= DECODE_LARGE_HEADS else (32, 1)


def variant_spec(variant: tuple, bf16_state: bool, state_layout: str, gate: str = DEFAULT_GATE):
    """The spec of a ``pick_variant`` result for ``gate``."""
    if variant[0] == "chunk":
        return DecodeChunkSpec(warps=variant[1], items=variant[2], gate=gate)
    v_block, items = variant
    return DecodeSpec(kv_layout=state_layout == "kv", bf16_state=bf16_state, v_block=v_block, items=items, gate=gate)
