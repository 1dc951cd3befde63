"""Which path a validated prefill call takes: serial (K1 then K2), the fused kernel, or the
intracard-CP chain (K1, pre_scan, merge, segmented K2), with the split, the kernel variant, and
what about a later call's lengths could change the choice (``Path``; ``choose_path`` says the
rules).  Nothing here launches; ``prepare.sm_count`` is the one device query.
"""

import dataclasses
import functools

from ..layout import FLAG_CHECKPOINT_OFFSETS, D
from ..specs import K2_SEGMENTED_V_BLOCK, auto_fused, auto_v_block
from . import cp_plan
from .call import PrefillCall
from .checks import fail, host_cu_seqlens
from .prefill_checks import Checked
from . import prepare


def resolve_split(intracard_cp, batch, seq_len, heads, cu_seqlens, host_cu, device) -> int:
    """A call's s_split (rule 1 of ``choose_path``; 1 = serial)."""
    if intracard_cp is False:
        return 1
    if cu_seqlens is not None and host_cu is None:
        # Lengths live on the device only: planning would need a sync.
        if intracard_cp == "auto":
            return 1
        fail(
            "intracard_cp needs the sequence lengths on the host: pass cu_seqlens_cpu "
            "(or check_seqlens='host', which copies cu_seqlens and synchronises)"
        )
    if type(intracard_cp) is int:
        return intracard_cp
    if intracard_cp == "truncated":
        return cp_plan.pieces_split(
            batch if host_cu is None else len(host_cu) - 1, heads, prepare.sm_count(device), D // K2_SEGMENTED_V_BLOCK
        )
    lengths = [seq_len] * batch if host_cu is None else [b - a for a, b in zip(host_cu, host_cu[1:])]
    s_split = planned_split(lengths, heads, device)
    return max(s_split, 2) if intracard_cp is True else s_split


def planned_split(lengths, heads: int, device) -> int:
    """The s_split ``intracard_cp="auto"`` takes for these host sequence lengths on ``device``
    (1 = serial)."""
    return _cached_split(tuple(lengths), heads, prepare.sm_count(device))


@functools.lru_cache(maxsize=256)
def _cached_split(lengths: tuple, heads: int, sms: int) -> int:
    # Eager "auto" calls re-plan from their lengths every time; a serving loop repeats a few
    # length sets, and the full search costs ~50 µs for one long sequence.  256 sets bound the
    # memory (a key holds every length of its batch).
    return cp_plan.auto_split(lengths, heads, sms, D // K2_SEGMENTED_V_BLOCK)


@functools.lru_cache(maxsize=256)
def _cached_piece_tiles(lengths: tuple, heads: int, sms: int) -> int:
    return cp_plan.fused_piece_tiles(lengths, heads, sms)


def fused_piece_plan(c: Checked, device) -> list:
    """The fused pieces of a validated call's sequences (``cp_plan.fused_pieces``)."""
    seqs = cp_plan.sequences(c.batch, c.seq_len, c.host_cu)
    lengths = tuple(length for _, length, _ in seqs)
    return cp_plan.fused_pieces(seqs, _cached_piece_tiles(lengths, c.heads, prepare.sm_count(device)))


@dataclasses.dataclass(frozen=True)
class Path:
    """Which path a validated call takes (``choose_path``) and that path's options."""

    # "serial" (K1 then K2), "fused" (one kernel), "cp" (K1, pre_scan, merge, segmented K2),
    # "fused_pieces" (the fused kernel over certified pieces: ``intracard_cp="truncated"``) or
    # "pieces" (K1, tile bounds, segmented K2 walking them: the same without the fused kernel)
    kind: str
    split: int | None  # the s_split a later call of this signature takes; None: planned from its host lengths
    # Serial paths: None when the fused choice is the signature's alone; else whether these host
    # lengths have equal tile counts, the one thing about them that ``auto_fused`` reads.
    lengths_uniform: bool | None = None
    v_block: int | None = None  # "serial": V columns per K2 CTA
    s_split: int = 1  # "cp": the split and its segment plan (``cp_plan.plan``)
    segments: list | None = None
    # Whether a checkpoint falls inside the call's sequences (``checkpoints_reached``; False: the
    # plain kernels run), and for a serial varlen path that knew it from host lengths
    # (checkpoint_every, reached), so that a later call's lengths pick their own plan.
    reached: bool | None = None
    checkpoint_reach: tuple | None = None


def choose_path(call: PrefillCall, c: Checked, device) -> Path:
    """The path of a validated call (``c``), by these rules in this order:

    1. The split s (``resolve_split``): 1 when ``intracard_cp`` is False.  A varlen call
       without host lengths (no ``cu_seqlens_cpu``, and ``check_seqlens`` "off", or "auto" with a
       device cu_seqlens) takes 1 under "auto" and is refused (KDAInputError) under True or an
       int.  Otherwise an int is s; "auto" is ``planned_split`` of the host lengths (a fixed-length
       batch's from its shape); True is that but at least 2.
    2. s > 1: host lengths not checked yet are checked now (a CP table is built from them), and
       ``cp_plan.plan`` cuts the sequences into at most s segments: "cp" when some sequence has
       more than one; else a serial path (nothing long enough to split).  Under "truncated":
       "fused_pieces" (``fused_piece_plan``) unless ``fused`` is False or the call's conventions
       are not the fused kernel's, then "pieces".
    3. Serial paths (``fused`` and ``v_block`` apply to these only): "fused" when ``fused`` is
       True, or it is None, ``v_block`` is None and ``specs.auto_fused`` picks it (from shapes,
       with a fixed-length batch's lower tile threshold for a varlen one whose host lengths all
       take the same number of tiles: ``equal_tile_counts``); else "serial" (K1 then K2) with
       ``v_block``, or ``specs.auto_v_block``'s when None.  The fused kernel runs the default
       input conventions only (``conventions`` = 0: the two runtime bits cost its register-bound
       producers 8% on the default ones): other calls take "serial", and ``fused=True`` with them
       is refused.
    4. ``split``, what the signature's cached plan does with a later call's lengths: serial paths
       1 (stay serial) when ``intracard_cp`` is False, the call is fixed-length or has no host
       lengths, else None (re-planned by rule 1 from each call's host lengths); "cp": s when
       fixed-length (the signature fixes the lengths), else None.  ``lengths_uniform`` and
       ``checkpoint_reach`` (serial paths) are set where rule 3's choice, or the checkpoint twin's
       elision (``checkpoints_reached``), turns on the host lengths, so that a later call with
       other lengths takes the plan its own lengths pick.
    """
    cu_seqlens, intracard_cp, fused, conventions = (
        call.cu_seqlens,
        call.intracard_cp,
        call.fused,
        call.inputs.conventions,
    )
    varlen = cu_seqlens is not None
    reached = checkpoints_reached(c, varlen, c.host_cu)
    s_split = resolve_split(intracard_cp, c.batch, c.seq_len, c.heads, cu_seqlens, c.host_cu, device)
    if s_split > 1 and c.host_cu is not None and not c.seqlens_checked:
        # A CP table is built from these host values, so they are checked whatever check_seqlens says.
        host_cu_seqlens(cu_seqlens, call.cu_seqlens_cpu, c.seq_len)
    if s_split > 1:
        segments = cp_plan.plan(cp_plan.sequences(c.batch, c.seq_len, c.host_cu), s_split)
        if intracard_cp == "truncated":
            if c.checkpoints.every:
                fail("intracard_cp='truncated' writes no prefix checkpoints: pass intracard_cp='auto' or False")
            if conventions and fused:
                _refuse_fused_conventions()
            split = None if varlen else s_split
            if fused is not False and not conventions:
                return Path("fused_pieces", split, s_split=s_split, segments=fused_piece_plan(c, device))
            return Path("pieces", split, s_split=s_split, segments=segments)
        if not all(len(s) == 1 for s in segments):
            return Path("cp", None if varlen else s_split, s_split=s_split, segments=segments, reached=reached)
        # Nothing long enough to split: the serial path is the same work, faster.
    # The serial decision is the signature's alone unless CP was planned from host lengths.
    split = 1 if intracard_cp is False or c.host_cu is None or not varlen else None
    if conventions and fused:
        _refuse_fused_conventions()
    lengths_uniform = None
    if fused is None:
        fused = False
        if not conventions and call.v_block is None:

            def pick(uniform):
                return auto_fused(c.heads, c.num_seqs, c.batch * c.seq_len, prepare.sm_count(device), uniform=uniform)

            lengths_known = varlen and c.host_cu is not None
            uniform = not varlen or (lengths_known and equal_tile_counts(c.host_cu))
            fused = pick(uniform)
            if lengths_known and pick(not uniform) != fused:
                lengths_uniform = uniform
    reach = (c.checkpoints.every, reached) if varlen and reached is not None else None
    if fused:
        return Path("fused", split, lengths_uniform=lengths_uniform, reached=reached, checkpoint_reach=reach)
    v_block = call.v_block
    if v_block is None:
        v_block = auto_v_block(c.heads, c.num_seqs, prepare.sm_count(device))
    return Path(
        "serial", split, v_block=v_block, lengths_uniform=lengths_uniform, reached=reached, checkpoint_reach=reach
    )


def _refuse_fused_conventions():
    fail(
        "the fused kernel runs beta as logits and q, k normalised in the kernel only "
        "(beta_sigmoid=True, qk_l2norm=True): pass fused=None or False"
    )


def checkpoints_reached(c, varlen: bool, host_cu):
    """Whether a checkpoint can fall inside a validated call's (``c``) sequences, as the host
    knows it: None where it cannot say or need not (no checkpoints; ``checkpoint_offsets``, device
    values; a varlen call without host lengths), else whether the longest sequence (``c``'s
    fixed length, or the host cu_seqlens ``host_cu``'s) reaches ``checkpoint_every``.  A call that
    reaches none runs the plain kernels: the checkpointing twins' loops cost their kernel up to
    ~5% where they write nothing (PERFORMANCE.md, Prefix-cache checkpoints)."""
    every = c.checkpoints.every
    if not every or c.checkpoints.flags & FLAG_CHECKPOINT_OFFSETS or (varlen and host_cu is None):
        return None
    return (longest(host_cu) if varlen else c.seq_len) >= every


def longest(host_cu) -> int:
    """The longest sequence of host cu_seqlens values."""
    return max((b - a for a, b in zip(host_cu, host_cu[1:])), default=0)


def equal_tile_counts(host_cu) -> bool:
    """Whether the sequences of host ``cu_seqlens`` values all take the same number of 16-token
    tiles: no fused item then outlasts the others, as in a fixed-length batch (ragged batches
    lose the fused kernel: PERFORMANCE.md, Serving matrix)."""
    return len({(b - a + 15) // 16 for a, b in zip(host_cu, host_cu[1:])}) == 1
