"""Workspace ABI shared by the kernels, the runtime and the tests (no cutlass, no GPU).

The qd/kd/kr workspaces are raw byte images of a 16×128 bf16 shared-memory tile in the
K_INTER layout: element (r, c) lives at byte ``2·((c//8)·128 + r·8 + c%8)``.  Slots are
numbered ``head · total_slots + tile_slot`` (see ``cula_aot/kernels/k1_prepare.py``).
"""

D = 128
CHUNK = 16
MAX_SEQS = 65535  # the CUDA grid's z extent: every kernel runs a sequence (or a piece of one) per z index
IMAGE_BYTES = CHUNK * D * 2
# Input tiles (q, k, g) reach shared memory as blocks of 32 columns (``kernels.common``'s
# ``input_tile_layout``; the TMA recipe ``specs.token_tma`` and its runtime values follow it).
INPUT_BLOCK_COLS = 32

# K2 ``flags`` bits (a launch argument; per row in a segment table).
FLAG_INITIAL_STATE = 1  # read initial_state[init_index]
FLAG_FINAL_STATE = 2  # write final_state[final_index]
FLAG_IDENTITY_INIT = 4  # start from S = I (pre_scan: the product of the tiles' A_t)
FLAG_ZERO_V = 8  # treat v as 0 (pre_scan's A_t product)
FLAG_NO_OUTPUT = 16  # do not write out (pre_scan)
# State pools (docs/CONTRACT.md §9): the row's state index is a sequence number n, and the state actually
# used is pool[state_indices[n]]; a negative entry means a zero start / no write (padding).
FLAG_INDEXED_INIT = 32
FLAG_INDEXED_FINAL = 64
# bf16 state tensors (the kernels carry fp32 inside; values are rounded once on store).
FLAG_BF16_INIT = 128
FLAG_BF16_FINAL = 256
# Serial varlen K2: grid row z runs the z-th longest sequence (ties in index order) instead of
# sequence z, so the longest chains start in the first wave (up to ``ORDER_MAX_SEQS`` sequences;
# beyond that, index order).  Scheduling only: results are bitwise the same.
FLAG_LONGEST_FIRST = 512
ORDER_MAX_SEQS = 128
# The fused prefill (one variant for fixed and varlen input): grid row z is sequence z of
# ``cu_seqlens`` (else rows z·seq_len ..).  A runtime bit, not a compile-time variant: the two
# compiled variants differed by up to 6% in speed on the same work (PERFORMANCE.md, Fused prefill).
FLAG_VARLEN = 1024
# The caller passed a status word (``status``): kernels OR ``STATUS_*`` bits into it.
FLAG_STATUS = 2048
# Input conventions, runtime bits of K1 and both decode kernels (fla's
# ``use_beta_sigmoid_in_kernel=False`` and ``use_qk_l2norm_in_kernel=False``; the fused kernel runs
# the default ones only): β is already the probability b (else a logit, b = σ(β)); q and k are
# used as given (else L2-normalised).
FLAG_BETA_PROBABILITY = 4096
FLAG_QK_AS_GIVEN = 8192
# Prefix-cache checkpoints (K2 and the fused prefill, ``checkpoint_every`` > 0): the checkpoint
# pool is bf16 (else fp32); each sequence's token positions start at ``checkpoint_offsets[n]``
# (else 0): see ``checkpoint_schedule``.
FLAG_BF16_CHECKPOINT = 16384
FLAG_CHECKPOINT_OFFSETS = 32768
# A fused-pieces row whose end state a later row may take: it publishes it (``SEG_PREDECESSOR``).
FLAG_SUCCESSOR = 65536

# Device values the kernels bound instead of trusting (a serving process must survive a bad
# scheduler value): every ``cu_seqlens`` entry is clamped into [0, T] and each sequence's end
# to at least its start; a pool slot outside [0, slots) is padding.  With a status word the
# kernels report what they met, so an engine can check it whenever it wants, with no sync.
STATUS_CU_SEQLENS_MALFORMED = 1  # an entry outside [0, T], a decrease, or a first entry other than 0
STATUS_SLOT_OUT_OF_RANGE = 2  # a state index >= the pool's slots, or negative other than -1
STATUS_CHECKPOINT_MISALIGNED = 4  # a checkpoint offset negative or not a multiple of 16: none written
# A num_accepted outside its range, clamped: the layer's [0, the pending draft's T] (or a bad draft
# mark: none committed), kda_decode's [1, T] with [N, T] state_indices.
STATUS_DRAFT_OUT_OF_RANGE = 8

# A K2 segment table row (int32): which tokens and tile slots a work item runs over, which
# state rows it reads and writes, and its flags.  Segments never cross a sequence boundary.
# SEG_SEQ_OFFSET: the tokens of its sequence before the segment (where its checkpoints fall).
(SEG_SEQ, SEG_FIRST_TOKEN, SEG_FIRST_SLOT, SEG_TOKENS, SEG_INIT_INDEX, SEG_FINAL_INDEX, SEG_FLAGS, SEG_SEQ_OFFSET) = (
    range(8)
)
SEGMENT_FIELDS = 8  # 32 bytes
# The fused pieces kernel's rows are segment rows, but it has no K1 workspace: its tile-slot field
# holds the row of the piece before it in its sequence (-1 for a sequence's first), whose
# published end state it takes when its own warm-up does not certify.  The rows with a successor
# (``FLAG_SUCCESSOR``) come first, so their published states and ready flags are the first rows'.
SEG_PREDECESSOR = SEG_FIRST_SLOT

# The per-slot workspaces: element dtype and bytes per (tile, head) slot.
WORKSPACE_DTYPES = {"qd": "bf16", "kd": "bf16", "kr": "bf16", "gt": "f32", "inv": "bf16", "mqk": "bf16", "b": "f32"}
WORKSPACE_SLOT_BYTES = {
    "qd": IMAGE_BYTES,
    "kd": IMAGE_BYTES,
    "kr": IMAGE_BYTES,
    "gt": D * 4,
    "inv": CHUNK * CHUNK * 2,
    "mqk": CHUNK * CHUNK * 2,
    "b": CHUNK * 4,
}

# One slot's workspaces are one record: the parts back to back in this order (every offset a
# multiple of 16), records ``WORKSPACE_RECORD_BYTES`` apart, slot-major.  K2 then stages a tile
# with one bulk copy of the whole record.  The parts the CP pre_scan reads come first (it writes
# no output, so it needs neither qd nor Mqk): its copy is the record's first
# ``PRESCAN_RECORD_BYTES``.
WORKSPACE_RECORD_ORDER = ("kd", "kr", "inv", "gt", "b", "qd", "mqk")
PRESCAN_RECORD_PARTS = WORKSPACE_RECORD_ORDER[:5]
WORKSPACE_PART_OFFSETS = {}
_offset = 0
for _part in WORKSPACE_RECORD_ORDER:
    WORKSPACE_PART_OFFSETS[_part] = _offset
    _offset += WORKSPACE_SLOT_BYTES[_part]
WORKSPACE_RECORD_BYTES = _offset  # 13 888
PRESCAN_RECORD_BYTES = sum(WORKSPACE_SLOT_BYTES[part] for part in PRESCAN_RECORD_PARTS)  # 9 280
assert WORKSPACE_RECORD_BYTES % 16 == 0 and all(o % 16 == 0 for o in WORKSPACE_PART_OFFSETS.values())
assert set(WORKSPACE_RECORD_ORDER) == set(WORKSPACE_SLOT_BYTES)


def k_inter_index(row, col):
    """Element (not byte) index of (row, col) in a K_INTER image (ints, DSL or torch values)."""
    return (col // 8) * (CHUNK * 8) + row * 8 + col % 8


def fixed_total_slots(batch: int, seq_len: int) -> int:
    """Tile slots per head for B sequences of T tokens: B·ceil(T/16)."""
    return batch * -(-seq_len // CHUNK)


def varlen_total_slots(total_tokens: int, num_seqs: int) -> int:
    """Tile slots per head for varlen input: (T + 15·N) // 16, an upper bound needing no sync."""
    return (total_tokens + (CHUNK - 1) * num_seqs) // CHUNK


def varlen_slot_base(cu_seqlens: list[int], seq: int) -> int:
    """First tile slot of sequence ``seq`` (the host twin of the device lookup)."""
    return (cu_seqlens[seq] + (CHUNK - 1) * seq) // CHUNK


def checkpoint_schedule(offset: int, tokens_before: int, every: int):
    """Where a work item's checkpoints fall: (first tile, first column), or None when ``offset``
    is misaligned (negative or not a multiple of 16: ``STATUS_CHECKPOINT_MISALIGNED``).

    Positions count from the request's start: this call's part of a sequence begins at position
    ``offset`` (``checkpoint_offsets[n]``, else 0), the item at ``offset + tokens_before`` (a CP
    segment's ``SEG_SEQ_OFFSET``).  A checkpoint is the state after every position that is a
    multiple of ``every`` (a multiple of 16), past the call's first token; column j of
    ``checkpoint_indices`` is the call's j-th.  The item's first lands after its tile
    ``first tile`` (its tiles start at its first token), then one every ``every / 16`` tiles,
    the column one further each time; the kernels write those whose tile is whole.  The device
    twin is ``kernels.tile_chain.checkpoint_schedule``."""
    if offset < 0 or offset % CHUNK:
        return None
    start = offset % every + tokens_before  # the item's first position, from the call's first block start
    first = every - start % every  # tokens into the item of its first checkpoint
    return first // CHUNK - 1, (start + first) // every - 1


def checkpoint_tiles(length: int, offset: int, tokens_before: int, every: int, columns: int):
    """(tile, column) of each checkpoint a ``length``-token item writes (``checkpoint_schedule``:
    whole tiles only, columns below ``columns``)."""
    schedule = checkpoint_schedule(offset, tokens_before, every)
    if schedule is None:
        return []
    tile, column = schedule
    out = []
    while (tile + 1) * CHUNK <= length and column < columns:
        out.append((tile, column))
        tile, column = tile + every // CHUNK, column + 1
    return out


def decode_k_inter(images):
    """Decode K_INTER byte images ``[..., 2048]`` (bf16 elements) into logical ``[..., 16, 128]``."""
    import torch

    rows = torch.arange(CHUNK).view(CHUNK, 1)
    cols = torch.arange(D).view(1, D)
    index = k_inter_index(rows, cols)
    return images.reshape(*images.shape[:-1], CHUNK * D)[..., index.to(images.device)]
