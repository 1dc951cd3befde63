"""Kernel specializations and their declared parameter ABI (no cutlass, no GPU).

One module per kernel, named after its kernel module in ``cula_aot/kernels/``: the
specialization class (every code-generation argument is a field, and its ``name`` is built from
all of them, so two different cubins can never share a name), its parameter list (the ABI the
runtime packs by name, written once, there), its variants, shared memory, grid and the rule that
dispatches to it.  ``abi`` holds the parameter kinds and the base class.  The build compiles
``default_specs()``.
"""

from .abi import (  # noqa: F401
    ARCH,
    CUTEDSL_VERSION,
    POINTER_ALIGN,
    SCALAR_TYPES,
    TMA_DESCRIPTOR_BYTES,
    TMA_DESCRIPTOR_ALIGN,
    Param,
    pointer,
    scalar,
    token_tma,
    abi_layout,
    KernelSpec,
    WORKSPACE_POINTERS,
    SEQUENCE_SCALARS,
    K1_INPUTS,
    TOKEN_SCALARS,
    state_params,
    STATUS_POINTER,
    bound_params,
    GATES,
    gate_field,
)
from .k1_prepare import (  # noqa: F401
    K1_PARAMS,
    K1Spec,
    K1_CTAS_PER_SM,
    K1_MAX_TILES_PER_CTA,
    K1_WAVES,
    k1_grid,
)
from .k2_recurrence import (  # noqa: F401
    K2_PARAMS,
    K2_V_BLOCKS,
    K2_MULTICAST_V_BLOCKS,
    K2_DEFAULT_V_BLOCK,
    K2_WIDE_V_BLOCK,
    K2_WIDE_V_BLOCK_WAVES,
    K2_WGMMA_V_BLOCK,
    K2_CTAS_PER_SM,
    auto_v_block,
    K2_SEGMENTED_V_BLOCK,
    K2_SEGMENTED_WIDE_V_BLOCK,
    K2_SEGMENTED_V_BLOCKS,
    K2_STAGES,
    K2_WARP_COLUMNS,
    k2_threads,
    K2Spec,
    serial_k2_spec,
    segmented_k2_spec,
    segmented_v_block,
)
from .fused_prefill import (  # noqa: F401
    FUSED_PARAMS,
    FUSED_PRODUCERS,
    FUSED_STAGES,
    FUSED_PRODUCER_REGISTERS,
    FUSED_CONSUMER_REGISTERS,
    fused_threads,
    FusedSpec,
    FusedPiecesSpec,
    FUSED_PIECES_PARAMS,
    PIECE_PARAMS,
    PIECE_WARMUP_TILES,
    fused_pieces_spec,
    FUSED_MIN_WAVES,
    FUSED_MIN_MEAN_TILES,
    FUSED_UNIFORM_MIN_MEAN_TILES,
    FUSED_LONG_MIN_WAVES,
    FUSED_LONG_MIN_MEAN_TILES,
    fused_spec,
    auto_fused,
)
from .cp_merge import (  # noqa: F401
    MERGE_PARAMS,
    MERGE_V_BLOCKS,
    MERGE_THREADS,
    merge_v_block,
    MergeSpec,
)
from .tile_bound import (  # noqa: F401
    TILE_BOUND_MARGIN_LOG2,
    TILE_BOUND_PARAMS,
    TILE_BOUND_WARPS,
    TRUNCATION_LOG2,
    WALK_TILES,
    TileBoundSpec,
    tile_bound_grid,
)
from .decode import (  # noqa: F401
    DECODE_MAX_TOKENS,
    DECODE_FLAG_ACCEPTED,
    DECODE_FLAG_INTERMEDIATE,
    DECODE_FLAG_STATUS,
    DECODE_FLAG_TOKEN_SLOTS,
    DECODE_VARIANTS,
    DECODE_TENSORS,
    DECODE_GEOMETRY,
    DECODE_PARAMS,
    decode_params,
    decode_threads,
    decode_stage_bytes,
    decode_token_bytes,
    decode_smem_bytes,
    DecodeSpec,
    DECODE_CHUNK_MAX_TOKENS,
    DECODE_CHUNK_VARIANTS,
    decode_chunk_stage_bytes,
    decode_chunk_smem_bytes,
    DecodeChunkSpec,
    decode_specs,
    DECODE_PAIRED_MIN_HEADS,
    DECODE_STREAMING_MIN_HEADS,
    DECODE_LARGE_HEADS,
    DECODE_CHUNK_STREAMING_MIN_HEADS,
    DECODE_CHUNK_PAIRED_MIN_HEADS,
    chunk_applies,
    pick_variant,
    variant_spec,
)
from .decode_layer import (  # noqa: F401
    CONV_WIDTH,
    DRAFT_BANKS,
    DRAFT_REPLAY_BYTES,
    DRAFT_ROWS,
    DRAFT_TOKENS,
    LAYER_FLAG_CONV_BIAS,
    LAYER_FLAG_CONV_STATE_F32,
    LAYER_FLAG_CONV_WEIGHT_F32,
    LAYER_FLAG_DRAFTS,
    LAYER_FLAG_NORM_WEIGHT_F32,
    LAYER_FLAG_STATUS,
    LAYER_FLAG_VERIFY,
    LAYER_PARAMS,
    LAYER_VARIANTS,
    DecodeLayerSpec,
    decode_layer_specs,
    draft_mark,
    pick_layer_variant,
)


def default_specs() -> list[KernelSpec]:
    """Every specialization the build produces.  None depends on the head count: H is the
    launch grid's second dimension, and the kernels read it from there."""
    specs: list[KernelSpec] = []
    for varlen in (False, True):
        specs.extend(K1Spec(varlen=varlen, gate=gate) for gate in GATES)
        specs.extend(K2Spec(varlen=varlen, v_block=vb) for vb in K2_V_BLOCKS)
        specs.extend(K2Spec(varlen=varlen, v_block=vb, multicast=True) for vb in K2_MULTICAST_V_BLOCKS)
        specs.extend(K2Spec(varlen=varlen, v_block=K2_WGMMA_V_BLOCK, multicast=m, wgmma=True) for m in (False, True))
        # The checkpoint twins of the variants the runtime launches.
        specs.extend(serial_k2_spec(varlen, vb, checkpointing=True) for vb in K2_V_BLOCKS)
    specs.extend(fused_spec(gate, checkpointing) for gate in GATES for checkpointing in (False, True))
    specs.extend(fused_pieces_spec(gate) for gate in GATES)
    # Intracard CP: segment tables carry absolute tokens and slots, so one variant serves fixed
    # and varlen input.
    specs.extend(segmented_k2_spec(vb, prescan) for prescan in (True, False) for vb in K2_SEGMENTED_V_BLOCKS)
    specs.extend(segmented_k2_spec(vb, checkpointing=True) for vb in K2_SEGMENTED_V_BLOCKS)
    specs.extend(segmented_k2_spec(vb, walk=True) for vb in K2_SEGMENTED_V_BLOCKS)
    specs.extend(MergeSpec(v_block=vb) for vb in MERGE_V_BLOCKS)
    specs.append(TileBoundSpec())
    specs.extend(decode_specs())
    specs.extend(decode_layer_specs())
    return specs
