"""The KDA prefill entry point (docs/CONTRACT.md §5, §6, §9): ``prefill`` validates its arguments
(``prefill_checks.validate``), takes the path ``choose_path`` names (serial K1 then K2, the fused
kernel, or the intracard-CP chain), builds that path's plan (``prefill_plans``) or reuses the one
cached for the call signature, and launches it on the current stream.

Validation runs entirely before the first launch, so a rejected call writes nothing.  The serial
path never reads a device tensor on the host: grids come from shapes (``layout.varlen_total_slots``)
and cu_seqlens values are checked on the host only when that is free (``cu_seqlens_cpu``, or a CPU
cu_seqlens) or asked for (``check_seqlens="host"``, a sync).  Inputs may be token-strided views;
states may be fp32 or bf16, plain or pools indexed by ``state_indices``.
"""

import dataclasses
import functools

from ..layout import FLAG_CHECKPOINT_OFFSETS, FLAG_LONGEST_FIRST, D
from ..runtime.loader import default_loader
from ..specs import K2_SEGMENTED_V_BLOCK, K1Spec, auto_fused, auto_v_block, fused_spec, serial_k2_spec
from . import cp_plan
from .checks import KDAInputError, call_inputs, fail  # noqa: F401 (KDAInputError: re-exported)
from .prefill_checks import STATE_LAYOUTS  # noqa: F401 (re-exported)
from .prefill_checks import NO_CHECKPOINTS, _host_cu_seqlens, _read_host_cu, validate
from .prefill_plans import _CPPlan, _FusedPlan, _SerialPlan, _state_options
from .prepare import sm_count as _sm_count

# The serial K2's grid order: varlen sequences longest first, so the longest chains start in the
# first wave (a fixed-length kernel ignores the bit; PERFORMANCE.md, K2 recurrence).  The fused
# kernel takes the same bit.
SERIAL_K2_ORDER = FLAG_LONGEST_FIRST


def _resolve_split(intracard_cp, batch, seq_len, heads, cu_seqlens, host_cu, device) -> int:
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
    lengths = [seq_len] * batch if host_cu is None else [b - a for a, b in zip(host_cu, host_cu[1:])]
    s_split = planned_split(lengths, heads, device)
    return max(s_split, 2) if intracard_cp is True else s_split


def planned_split(lengths, heads: int, device) -> int:
    """The s_split ``intracard_cp="auto"`` takes for these host sequence lengths on ``device``
    (1 = serial)."""
    return _cached_split(tuple(lengths), heads, _sm_count(device))


@functools.lru_cache(maxsize=256)
def _cached_split(lengths: tuple, heads: int, sm_count: int) -> int:
    # Eager "auto" calls re-plan from their lengths every time; a serving loop repeats a few
    # length sets, and the full search costs ~50 µs for one long sequence.  256 sets bound the
    # memory (a key holds every length of its batch).
    return cp_plan.auto_split(lengths, heads, sm_count, D // K2_SEGMENTED_V_BLOCK)


@dataclasses.dataclass(frozen=True)
class Path:
    """Which path a validated call takes (``choose_path``) and that path's options."""

    kind: str  # "serial" (K1 then K2), "fused" (one kernel) or "cp" (K1, pre_scan, merge, segmented K2)
    split: int | None  # the s_split a later call of this signature takes; None: planned from its host lengths
    # Serial paths: None when the fused choice is the signature's alone; else whether these host
    # lengths have equal tile counts, the one thing about them that ``auto_fused`` reads.
    lengths_uniform: bool | None = None
    v_block: int | None = None  # "serial": V columns per K2 CTA
    s_split: int = 1  # "cp": the split and its segment plan (``cp_plan.plan``)
    segments: list | None = None


def choose_path(c, intracard_cp, cu_seqlens, cu_seqlens_cpu, fused, v_block, device, conventions=0) -> Path:
    """The path of a validated call (``c``), by these rules in this order:

    1. The split s (``_resolve_split``): 1 when ``intracard_cp`` is False.  A varlen call
       without host lengths (no ``cu_seqlens_cpu``, and ``check_seqlens`` "off", or "auto" with a
       device cu_seqlens) takes 1 under "auto" and is refused (KDAInputError) under True or an
       int.  Otherwise an int is s; "auto" is ``planned_split`` of the host lengths (a fixed-length
       batch's from its shape); True is that but at least 2.
    2. s > 1: host lengths not checked yet are checked now (a CP table is built from them), and
       ``cp_plan.plan`` cuts the sequences into at most s segments: "cp" when some sequence has
       more than one; else a serial path (nothing long enough to split).
    3. Serial paths (``fused`` and ``v_block`` apply to these only): "fused" when ``fused`` is
       True, or it is None, ``v_block`` is None and ``specs.auto_fused`` picks it (from shapes,
       with a fixed-length batch's lower tile threshold for a varlen one whose host lengths all
       take the same number of tiles: ``equal_tile_counts``); else "serial" (K1 then K2) with
       ``v_block``, or ``specs.auto_v_block``'s when None.  The fused kernel runs the default input conventions only (``conventions`` = 0: the two
       runtime bits cost its register-bound producers 8% on the default ones): other calls take
       "serial", and ``fused=True`` with them is refused.
    4. ``split``, what the signature's cached plan does with a later call's lengths: serial paths
       1 (stay serial) when ``intracard_cp`` is False, the call is fixed-length or has no host
       lengths, else None (re-planned by rule 1 from each call's host lengths); "cp": s when
       fixed-length (the signature fixes the lengths), else None.  ``lengths_uniform`` (serial
       paths) is set where rule 3's choice turns on the host lengths' tile counts, so that a
       later call with other lengths takes the plan its own lengths pick.
    """
    varlen = cu_seqlens is not None
    s_split = _resolve_split(intracard_cp, c.batch, c.seq_len, c.heads, cu_seqlens, c.host_cu, device)
    if s_split > 1 and c.host_cu is not None and not c.seqlens_checked:
        # A CP table is built from these host values, so they are checked whatever check_seqlens says.
        _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, c.seq_len)
    if s_split > 1:
        segments = cp_plan.plan(cp_plan.sequences(c.batch, c.seq_len, c.host_cu), s_split)
        if not all(len(s) == 1 for s in segments):
            return Path("cp", None if varlen else s_split, s_split=s_split, segments=segments)
        # Nothing long enough to split: the serial path is the same work, faster.
    # The serial decision is the signature's alone unless CP was planned from host lengths.
    split = 1 if intracard_cp is False or c.host_cu is None or not varlen else None
    if conventions and fused:
        fail(
            "the fused kernel runs beta as logits and q, k normalised in the kernel only "
            "(beta_sigmoid=True, qk_l2norm=True): pass fused=None or False"
        )
    lengths_uniform = None
    if fused is None:
        fused = False
        if not conventions and v_block is None:

            def pick(uniform):
                return auto_fused(c.heads, c.num_seqs, c.batch * c.seq_len, _sm_count(device), uniform=uniform)

            lengths_known = varlen and c.host_cu is not None
            uniform = not varlen or (lengths_known and equal_tile_counts(c.host_cu))
            fused = pick(uniform)
            if lengths_known and pick(not uniform) != fused:
                lengths_uniform = uniform
    if fused:
        return Path("fused", split, lengths_uniform=lengths_uniform)
    if v_block is None:
        v_block = auto_v_block(c.heads, c.num_seqs, _sm_count(device))
    return Path("serial", split, v_block=v_block, lengths_uniform=lengths_uniform)


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


_PLANS: dict = {}  # signature → its serial or first CP plan; (signature, lengths, s_split) → CP plan
_PLAN_LIMIT = 256  # plans cached; cleared when full (a serving loop reuses a few)


def _signature(*tensors) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _serial_key(key, lengths_uniform, checkpoints_reached) -> tuple:
    """The cache key of a serial plan chosen for host lengths: with (or without) equal tile counts,
    reaching a checkpoint (or not); None where the plan's choice does not turn on that."""
    return key, "serial", lengths_uniform, checkpoints_reached


def _length_facts(plan, host_cu) -> tuple:
    """What a serial plan's choice turned on, for a call's host lengths: (equal tile counts,
    checkpoint reached), None where the plan's choice does not turn on it."""
    uniform = None if plan.lengths_uniform is None else equal_tile_counts(host_cu)
    reached = None if plan.checkpoint_reach is None else longest(host_cu) >= plan.checkpoint_reach[0]
    return uniform, reached


def _cp_key(key, host_cu, s_split) -> tuple:
    """A CP plan's cache key: the call signature, the host cu_seqlens (None: fixed length) and the split."""
    return key, None if host_cu is None else tuple(host_cu), s_split


def _remember(key, plan) -> None:
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


def _plan_for_lengths(plan, key, cu_seqlens, cu_seqlens_cpu):
    """The cached plan for a call whose signature ``key`` has cached ``plan``, by ``choose_path``'s
    rules on this call's lengths: (that plan, None when there is none yet; the host cu_seqlens
    read to choose it: checked when the signature checks them)."""
    if plan.split == 1 and plan.lengths_uniform is None and plan.checkpoint_reach is None:
        return plan, None
    c = plan.c
    host_cu = None
    if plan.split is None or plan.lengths_uniform is not None or plan.checkpoint_reach is not None:
        host_cu = _read_host_cu(cu_seqlens, cu_seqlens_cpu, c.seqlens_checked, c.seq_len)
    if plan.split is None:
        s_split = _resolve_split(plan.intracard_cp, c.batch, c.seq_len, c.heads, cu_seqlens, host_cu, plan.device)
    else:
        s_split = plan.split
    if s_split > 1:
        return _PLANS.get(_cp_key(key, host_cu, s_split)), host_cu
    if not plan.serial:
        return None, host_cu
    facts = _length_facts(plan, host_cu)
    if facts != plan.length_facts:
        return _PLANS.get(_serial_key(key, *facts)), host_cu
    return plan, host_cu


def prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    state_layout="vk",
    out=None,
    final_state=None,
    intracard_cp="auto",
    state_indices=None,
    check_seqlens="auto",
    v_block=None,
    fused=None,
    status=None,
    gate="safe",
    beta_sigmoid=True,
    qk_l2norm=True,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
):
    """K1 then K2 (serial), or K1, pre_scan, merge and segmented K2 (intracard CP), all on
    ``torch.cuda.current_stream(q.device)``.

    ``check_seqlens``: "auto" checks cu_seqlens values on the host when that costs no sync
    (``cu_seqlens_cpu`` given or cu_seqlens on the CPU) and trusts a device-only cu_seqlens;
    "host" always checks (a device cu_seqlens is copied: a sync); "off" never checks.  Unchecked
    values are the caller's contract (non-decreasing from 0 to T; empty sequences are harmless).
    ``state_indices`` (int32 [N], device): initial/final states are pools ``[slots, H, 128, 128]``
    and sequence n uses slot ``state_indices[n]`` (< 0: zero start, no write); in place when the
    same pool is both.  The kernels bound every device value instead of trusting it: a
    cu_seqlens entry is clamped into [0, T] and a sequence's end to at least its start, an index
    outside the pool is padding; ``status`` (a one-element int32 device tensor the caller owns
    and zeroes) then gets ``layout.STATUS_*`` bits ORed in, with no sync.

    ``v_block``: V columns per serial K2 CTA (16, 32 or 64, as built); None picks 32 or 64 from
    the grid size (``specs.auto_v_block``).  ``fused``: run the serial path as the fused kernel
    (True), as K1 then K2 (False), or pick by the number of (sequence, head) items (None,
    ``specs.auto_fused``; a given ``v_block`` then means K1 then K2).

    A call signature seen before skips the structural checks (they depend on nothing else) and
    launches from cached templates: the serial path (``_SerialPlan``, ``_FusedPlan``), or the CP
    chain for lengths and a split seen before (``_CPPlan``); a new one takes the path
    ``choose_path`` names.  ``gate`` picks the kernels' decay, ``beta_sigmoid`` and ``qk_l2norm``
    the input conventions (``checks.call_inputs``); ``checkpoint_*`` the prefix-cache
    checkpoints (``api.kda_prefill``; ``checkpoint_every`` is part of the signature, the
    tensors' addresses per call)."""
    A_log, dt_bias, lower_bound, g, beta, conventions = call_inputs(
        gate, A_log, dt_bias, lower_bound, q, g, beta, beta_sigmoid, qk_l2norm
    )
    if state_indices is not None and output_final_state and final_state is None:
        final_state = initial_state  # a pool's final states go back where they came from
    checkpoints = (checkpoint_pool, checkpoint_indices, checkpoint_offsets)
    try:
        key = (
            _signature(
                q,
                k,
                v,
                g,
                beta,
                A_log,
                dt_bias,
                initial_state,
                final_state,
                out,
                cu_seqlens,
                cu_seqlens_cpu,
                state_indices,
                status,
                *checkpoints,
            ),
            state_layout,
            type(intracard_cp),
            intracard_cp,
            bool(output_final_state),
            check_seqlens,
            v_block,
            fused,
            gate,
            conventions,
            type(checkpoint_every),
            checkpoint_every,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: validate says which
        key = plan = None
    if plan is not None:
        plan, host_cu = _plan_for_lengths(plan, key, cu_seqlens, cu_seqlens_cpu)
        if plan is not None:
            return plan.run(
                q,
                k,
                v,
                g,
                beta,
                A_log,
                dt_bias,
                lower_bound,
                scale,
                initial_state,
                final_state,
                out,
                cu_seqlens,
                cu_seqlens_cpu,
                state_indices,
                status,
                host_cu,
                checkpoints,
            )

    c = validate(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        state_layout=state_layout,
        out=out,
        final_state=final_state,
        intracard_cp=intracard_cp,
        state_indices=state_indices,
        check_seqlens=check_seqlens,
        status=status,
        checkpoint_every=checkpoint_every,
        checkpoint_pool=checkpoint_pool,
        checkpoint_indices=checkpoint_indices,
        checkpoint_offsets=checkpoint_offsets,
    )
    device = q.device
    path = choose_path(c, intracard_cp, cu_seqlens, cu_seqlens_cpu, fused, v_block, device, conventions)
    heads, varlen = c.heads, cu_seqlens is not None
    reached = checkpoints_reached(c, varlen, c.host_cu)
    if reached is False:  # the plain kernels: nothing to write (the checkpoint tensors were checked)
        c = dataclasses.replace(c, checkpoints=NO_CHECKPOINTS)
    loader = default_loader()
    # Resolve every kernel first: a missing cubin fails before anything launches.
    k1 = loader.get(device, K1Spec(varlen=varlen, gate=gate))
    options = dict(
        cu_seqlens=cu_seqlens,
        state_layout=state_layout,
        device=device,
        intracard_cp=intracard_cp,
        split=path.split,
        input_flags=conventions,
        **_state_options(initial_state, final_state, output_final_state, state_indices, status),
    )
    if path.kind == "cp":
        # The CP plan is this signature's, these lengths' and this split's: a varlen call re-plans its
        # split from its lengths, a fixed-length one has them in the signature.
        plan = _CPPlan(c, loader, k1, path.segments, path.s_split, sm_count=_sm_count(device), **options)
        if key is not None:
            _remember(_cp_key(key, c.host_cu, path.s_split), plan)
            if key not in _PLANS:  # the signature's first plan: it reads later calls' lengths
                _remember(key, plan)
    else:
        if path.kind == "fused":
            plan = _FusedPlan(
                c,
                loader.get(device, fused_spec(gate, c.checkpoints.every > 0)),
                order=SERIAL_K2_ORDER,
                lengths_uniform=path.lengths_uniform,
                **options,
            )
        else:
            plan = _SerialPlan(
                c,
                k1,
                loader.get(device, serial_k2_spec(varlen, path.v_block, c.checkpoints.every > 0)),
                sm_count=_sm_count(device),
                order=SERIAL_K2_ORDER,
                lengths_uniform=path.lengths_uniform,
                **options,
            )
        if varlen and reached is not None:  # later calls' host lengths may reach a checkpoint, or not
            plan.checkpoint_reach = (checkpoint_every, reached)
        # Under "auto" with host lengths (split None) the plan re-plans each call (cheaply) and is
        # kept while serial; True or an s_split with host lengths keeps no serial plan.
        if key is not None and (path.split == 1 or intracard_cp == "auto"):
            _remember(key, plan)
            if plan.length_facts != (None, None):  # a later call with other kinds of lengths finds its own
                _remember(_serial_key(key, *plan.length_facts), plan)
    return plan.run(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        lower_bound,
        scale,
        initial_state,
        final_state,
        out,
        cu_seqlens,
        cu_seqlens_cpu,
        state_indices,
        status,
        c.host_cu,
        checkpoints,
    )
