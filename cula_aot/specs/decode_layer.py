"""The fused decode layer (``kernels/decode_layer.py``): the short-convolution update, the gate,
the KDA step and the sigmoid-gated RMSNorm of T = 1..8 tokens per request in one launch.  Its
parameter list, variants, shared memory, grid and cluster, and the dispatch."""

import dataclasses
from typing import ClassVar

from .abi import STATUS_POINTER, TOKEN_SCALARS, KernelSpec, pointer, scalar
from .decode import (
    DECODE_FLAG_STATUS,
    DECODE_GEOMETRY,
    DECODE_PAIRED_MIN_HEADS,
    DECODE_STREAMING_MIN_HEADS,
    STEP_TENSORS,
    TokenStepSpec,
    decode_smem_bytes,
)

CONV_WIDTH = 4  # taps of the short convolution (its state keeps CONV_WIDTH − 1 inputs)
CONV_STATE_TAPS = CONV_WIDTH - 1

# ``flags`` bits of the layer kernel, beside DECODE_FLAG_STATUS and the input conventions'
# (``layout.FLAG_BETA_PROBABILITY``, ``FLAG_QK_AS_GIVEN``): the dtypes read at run time, so one
# cubin serves the bf16 and fp32 forms engines keep (model-dtype weights, either conv state).
LAYER_FLAG_STATUS = DECODE_FLAG_STATUS
LAYER_FLAG_CONV_STATE_F32 = 1 << 16  # the conv states are fp32 (else bf16)
LAYER_FLAG_CONV_WEIGHT_F32 = 1 << 17  # the conv weights and biases are fp32 (else bf16)
LAYER_FLAG_CONV_BIAS = 1 << 18  # the convolutions have a bias
LAYER_FLAG_NORM_WEIGHT_F32 = 1 << 19  # the RMSNorm weight is fp32 (else bf16)
LAYER_FLAG_DRAFTS = 1 << 20  # draft buffers are given: a slot's pending draft is committed first
LAYER_FLAG_VERIFY = 1 << 21  # this call's tokens are a draft: recorded, not committed

# Speculative drafts.  Per slot, two banks of records (the draft of the last verify call, and the
# one being written: no CTA overwrites what another may still read), each ``DRAFT_TOKENS`` tokens
# × H heads × ``DRAFT_ROWS`` bf16 rows of 128 (1.5 KB a token and head): the raw q, k, v inputs
# (the conv state's history), the raw gate input g, and u (the delta-rule update per V row, fp32
# over the last two rows).  A mark per slot and head says which bank holds a pending draft and how
# many tokens it has (``draft_mark``; 0: none).  A draft of T tokens with a accepted rebuilds the
# state after them as S ← S·diag(α_t) + u_t k̂_tᵀ, t < a, where k̂_t (the convolution of the
# recorded inputs over the committed conv state) and α_t (the gate of the recorded g) are computed
# again, bit for bit as the draft computed them: its inputs are exact in bf16.
DRAFT_BANKS = 2
DRAFT_TOKENS = 8
DRAFT_ROWS = 6
DRAFT_X, DRAFT_G, DRAFT_U = 0, 3, 4  # DRAFT_X + 0, 1, 2: q, k, v; DRAFT_U: 128 fp32 over rows 4, 5
# A commit's k̂ and α of the accepted tokens, in shared memory behind the per-token arrays: a
# launch with drafts asks for these bytes more.
DRAFT_REPLAY_BYTES = 2 * DRAFT_TOKENS * 128 * 4


def draft_mark(bank, tokens):
    """The mark of a pending draft of ``tokens`` tokens in ``bank``: 1 + bank + 2·tokens (3 .. 18;
    anything else but 0 is refused on the device).  Works on ints and on device integers."""
    return 1 + bank + 2 * tokens


# (V rows per item, items per CTA): the V blocks of one (request, head) form one cluster, which
# shares the RMSNorm's sums through distributed shared memory and orders the q/k conv-state
# update after every CTA of the head has read the old state.
LAYER_VARIANTS = ((32, 1), (32, 2), (32, 4))

LAYER_TENSORS = (
    *STEP_TENSORS,  # q, k, v before their convolution; g raw, β logits (as in decode)
    pointer("out", "bf16"),
    STATUS_POINTER,
    pointer("out_gate", "bf16"),  # the RMSNorm's output-gate input
    # Conv states (read and written element by element at any strides: 2-byte aligned, e.g.
    # fla's cache[..., 1:]), weights ([C, 4] rows) and biases of q, k and v; dtypes by ``flags``.
    *(pointer(f"conv_state_{x}", "u8", address_align=2) for x in "qkv"),
    *(pointer(f"conv_weight_{x}", "u8") for x in "qkv"),
    *(pointer(f"conv_bias_{x}", "u8") for x in "qkv"),
    pointer("norm_weight", "u8"),
    # Draft records [slots, DRAFT_BANKS, DRAFT_TOKENS, H, DRAFT_ROWS, 128] bf16, the marks
    # [slots, H] and the accepted draft tokens per request [N] (int32, read one by one).
    pointer("draft_records", "bf16"),
    pointer("draft_marks", "i32", address_align=4),
    pointer("num_accepted", "i32", address_align=4),
)
# The conv states' element strides (shared by q, k and v: three pools of one shape, or channel
# slices of one packed pool) and the output gate's sequence and token strides.
LAYER_CONV_GEOMETRY = (
    *(scalar(f"conv_{axis}_stride", "i32") for axis in ("slot", "channel", "tap")),
    *(scalar(f"out_gate_stride_{axis}", "i32") for axis in ("n", "t")),
)
LAYER_PARAMS = (
    *LAYER_TENSORS,
    *DECODE_GEOMETRY,
    *LAYER_CONV_GEOMETRY,
    *TOKEN_SCALARS,
    scalar("norm_eps", "f32", per_call=True),
)

NORM_SUM_BYTES = 64  # the per-token RMSNorm partial sums (8 fp32), with alignment slack


def layer_smem_bytes(v_block: int, items: int, bf16_state: bool, tokens: int | None = None, *, drafts: bool) -> int:
    """Dynamic shared memory of a layer CTA: the decode kernel's (``decode_smem_bytes``), the
    RMSNorm's per-token sums and, with ``drafts``, a commit's replay arrays; without ``tokens``,
    the most any launch asks for."""
    token_bytes = decode_smem_bytes(v_block, items, bf16_state, *(() if tokens is None else (tokens,)))
    return token_bytes + NORM_SUM_BYTES + (DRAFT_REPLAY_BYTES if drafts else 0)


@dataclasses.dataclass(frozen=True)
class DecodeLayerSpec(TokenStepSpec):
    """The fused decode layer: the ``ctas_per_head`` V blocks of a (request, head) one cluster."""

    kernel: ClassVar[str] = "kda_decode_layer"
    declared_params: ClassVar[tuple] = LAYER_PARAMS

    @property
    def cluster(self) -> tuple:
        return (self.ctas_per_head, 1, 1)

    def launch_smem_bytes(self, tokens: int, *, drafts: bool) -> int:
        return layer_smem_bytes(self.v_block, self.items, self.bf16_state, tokens, drafts=drafts)


def decode_layer_specs() -> list[KernelSpec]:
    """Every layer specialization: both state layouts and dtypes, every variant and gate."""
    return DecodeLayerSpec.every(LAYER_VARIANTS)


def pick_layer_variant(num_seqs: int, heads: int, tokens: int, bf16_state: bool) -> tuple:
    """(v_block, items) of a layer launch: the decode token kernel's split (``pick_variant``) —
    small grids spread a head over four CTAs, larger ones stream two or four items per CTA."""
    nh = num_seqs * heads
    if nh < DECODE_PAIRED_MIN_HEADS:
        return 32, 1
    if bf16_state and tokens > 1 and nh >= DECODE_STREAMING_MIN_HEADS:
        return 32, 4
    return 32, 2
