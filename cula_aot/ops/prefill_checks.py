"""The prefill's argument validation (CPU-testable: nothing here launches).

``validate`` takes a ``PrefillCall`` and checks every argument before anything launches, with the
validators prefill shares with decode and the distributed prefill (``checks``), and returns the
facts a plan is built from (``Checked``); the device rule comes last, so every other rule is
testable on the CPU.  ``check_addresses`` holds the per-call rules (alignment, aliasing) a cached
plan re-checks.
"""

import dataclasses

import torch

from ..layout import CHUNK, D, FLAG_BF16_CHECKPOINT, FLAG_CHECKPOINT_OFFSETS
from .call import CheckpointSink, PrefillCall
from .checks import (
    check_contiguous,
    check_cu_seqlens,
    check_device,
    check_dtype_shape,
    check_num_seqs,
    check_scalars,
    check_slot_indices,
    check_state,
    check_state_layout,
    check_status,
    fail,
    read_host_cu,
)

SEQLEN_CHECKS = ("auto", "host", "off")


def check_token_tensor(name, t, dtype, shape, device, packed: tuple, aligned_rows: bool = True) -> int:
    """Check a token-major input/output ``[B, T, *packed dims]`` that may be a token-strided view
    (e.g. a slice of one fused projection): the trailing dims must be packed, rows 16-byte
    aligned, and batches ``T`` rows apart.  Returns the token stride in elements."""
    check_dtype_shape(name, t, dtype, shape, device)
    strides, inner = t.stride(), 1
    for dim in range(t.dim() - 1, 1, -1):  # the packed dims, innermost first (size-1 dims: any stride)
        if shape[dim] > 1 and strides[dim] != inner:
            fail(
                f"{name} must have its last {t.dim() - 2} dims packed (strides ..., {', '.join(map(str, packed))}); "
                f"got strides {list(strides)}: only the token dim may be strided; call {name}.contiguous()"
            )
        inner *= shape[dim]
    batch, seq_len = shape[0], shape[1]
    row = strides[1] if seq_len > 1 else (strides[0] if batch > 1 else inner)
    if row < inner:
        fail(
            f"{name}'s token stride {row} is smaller than a token's {inner} elements (overlapping rows); "
            f"call {name}.contiguous()"
        )
    if batch > 1 and seq_len > 1 and strides[0] != seq_len * row:
        fail(
            f"{name}'s batch stride {strides[0]} must be T x token stride = {seq_len * row}; "
            f"call {name}.contiguous() or flatten to varlen [1, B*T, ...] with cu_seqlens"
        )
    if aligned_rows and row * t.element_size() % 16:
        fail(f"{name} must have 16-byte aligned rows (token stride {row} elements); call {name}.contiguous()")
    return row


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """A call's prefix-cache checkpoints as the kernels take them (``specs.abi.CHECKPOINT_PARAMS``):
    the period in tokens (0: none), columns of ``checkpoint_indices``, the pool's slots and slot
    stride, and its flag bits (bf16 pool, per-sequence offsets)."""

    every: int = 0
    columns: int = 0
    slots: int = 0
    slot_stride: int = 0
    flags: int = 0


NO_CHECKPOINTS = CheckpointPlan()
CHECKPOINT_EVERY_MAX = 1 << 30


def check_checkpoints(sink: CheckpointSink, num_seqs: int, heads: int, device) -> CheckpointPlan:
    """``kda_prefill``'s checkpoint arguments (see its docstring): all or none of every, pool and
    indices; the pool a state pool like ``initial_state``'s, indices int32 ``[N, M]`` and offsets
    int32 ``[N]``, both contiguous on q's device."""
    every, pool, indices, offsets = sink
    if every is None or (type(every) is int and every == 0):
        if pool is not None or indices is not None or offsets is not None:
            fail(
                "checkpoint_pool, checkpoint_indices and checkpoint_offsets need checkpoint_every "
                "(the period in tokens, a multiple of 16)"
            )
        return NO_CHECKPOINTS
    if type(every) is not int or every < 0 or every % CHUNK or every > CHECKPOINT_EVERY_MAX:
        fail(
            f"checkpoint_every must be a positive int multiple of {CHUNK} (at most 2**30), or 0 for none; got {every!r}"
        )
    if pool is None or indices is None:
        fail(
            "checkpoint_every needs checkpoint_pool ([slots, H, 128, 128], fp32 or bf16) and checkpoint_indices "
            "(int32 [N, M]: the pool slot of each sequence's j-th checkpoint, -1 to skip)"
        )
    slot_stride = check_state("checkpoint_pool", pool, heads, device)
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 2
        or indices.shape[0] != num_seqs
        or indices.shape[1] < 1
    ):
        got = list(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        fail(
            f"checkpoint_indices must be [N, M] = [{num_seqs}, M >= 1] (a slot per sequence and checkpoint), got {got}"
        )
    check_contiguous("checkpoint_indices", indices, torch.int32, tuple(indices.shape), device)
    if indices.numel() >= 2**31:
        fail(f"checkpoint_indices has {indices.numel()} entries; at most 2**31 - 1 fit the kernels' int32 index")
    flags = FLAG_BF16_CHECKPOINT if pool.dtype == torch.bfloat16 else 0
    if offsets is not None:
        check_contiguous("checkpoint_offsets", offsets, torch.int32, (num_seqs,), device)
        flags |= FLAG_CHECKPOINT_OFFSETS
    return CheckpointPlan(every, indices.shape[1], pool.shape[0], slot_stride, flags)


def check_addresses(call: PrefillCall) -> None:
    """Per-call rules on addresses: 16-byte aligned bases (the kernels' pointer and TMA
    assumption) and outputs that do not alias an input."""
    sink, x = call.checkpoints, call.inputs
    named = {
        "q": x.q,
        "k": x.k,
        "v": x.v,
        "g": x.g,
        "beta": x.beta,
        "A_log": x.gate.A_log,
        "dt_bias": x.gate.dt_bias,
        "initial_state": call.initial_state,
        "final_state": call.final_state,
        "out": call.out,
        "state_indices": call.state_indices,
        "status": call.status,
        "checkpoint_pool": sink.pool,
        "checkpoint_indices": sink.indices,
        "checkpoint_offsets": sink.offsets,
    }
    for name, t in named.items():
        if t is not None and t.data_ptr() % 16:
            fail(f"{name} must start on a 16-byte boundary (its storage offset breaks it); call {name}.clone()")
    inputs = (x.q.data_ptr(), x.k.data_ptr(), x.v.data_ptr(), x.g.data_ptr())
    for name, t in (("out", call.out), ("final_state", call.final_state), ("checkpoint_pool", sink.pool)):
        if t is not None and t.data_ptr() in inputs:
            fail(f"{name} must not alias an input tensor")


@dataclasses.dataclass
class Checked:
    """What ``validate`` derived from the arguments: geometry, strides and the state plan."""

    batch: int
    seq_len: int
    heads: int
    num_seqs: int
    scale: float
    host_cu: list | None  # host copy of cu_seqlens values when available without a sync
    seqlens_checked: bool  # host_cu's values were checked (and must be again on every call)
    strides: dict  # token strides (elements) of q, k, v, g, beta and out (when given)
    init_slot_stride: int
    final_slot_stride: int
    init_slots: int  # leading size of initial_state (pool slots), 0 without one
    final_slots: int
    checkpoints: CheckpointPlan = NO_CHECKPOINTS


def _check_seqlens_choice(check_seqlens, cu_seqlens, cu_seqlens_cpu) -> bool:
    """Whether to check cu_seqlens values on the host (see ``prefill``)."""
    if check_seqlens == "off":
        return False
    if check_seqlens == "host":
        return True  # a device cu_seqlens is read (a sync) by host_cu_seqlens, which refuses it under capture
    return cu_seqlens_cpu is not None or not cu_seqlens.is_cuda  # "auto": only when it costs no sync


def validate(call: PrefillCall) -> Checked:
    """Check every argument of ``call`` before anything launches (the device rule last, so every
    other rule is testable on the CPU)."""
    x = call.inputs
    q = x.q
    if not isinstance(q, torch.Tensor):
        fail(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        fail(f"q must be [B, T, H, {D}], got shape {list(q.shape)}")
    batch, seq_len, heads, dim = q.shape
    if dim != D:
        fail(f"head dim must be {D} (cula_aot builds D = K = V = {D} only), got q.shape[-1] = {dim}")
    if seq_len == 0 or batch == 0 or heads == 0:
        fail(f"q must have B, T, H > 0, got shape {list(q.shape)}")
    device = q.device
    token_shape = (batch, seq_len, heads, D)
    strides = {
        name: check_token_tensor(name, t, torch.bfloat16, token_shape, device, (D, 1))
        for name, t in (("q", q), ("k", x.k), ("v", x.v), ("g", x.g))
    }
    beta_stride = check_token_tensor(
        "beta", x.beta, torch.bfloat16, (batch, seq_len, heads), device, (1,), aligned_rows=False
    )
    check_contiguous("A_log", x.gate.A_log, torch.float32, (heads,), device)
    check_contiguous("dt_bias", x.gate.dt_bias, torch.float32, (heads, D), device)
    _, scale = check_scalars(x.gate.lower_bound, x.scale)
    check_state_layout(call.state_layout)
    if call.check_seqlens not in SEQLEN_CHECKS:
        fail(f"check_seqlens must be one of {SEQLEN_CHECKS}, got {call.check_seqlens!r}")

    # Identity tests: 0 == False and 1 == True, but 0 is no s_split.
    cp = call.intracard_cp
    if not (cp is True or cp is False or cp in ("auto", "truncated") or (type(cp) is int and cp >= 1)):
        fail(f"intracard_cp must be 'auto', 'truncated', True, False or an int s_split >= 1, got {cp!r}")

    num_seqs = batch
    host_cu = None
    seqlens_checked = False
    cu_seqlens, cu_seqlens_cpu = call.cu_seqlens, call.cu_seqlens_cpu
    if cu_seqlens is not None:
        num_seqs = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, batch, device)
        seqlens_checked = _check_seqlens_choice(call.check_seqlens, cu_seqlens, cu_seqlens_cpu)
        host_cu = read_host_cu(cu_seqlens, cu_seqlens_cpu, seqlens_checked, seq_len)
    elif cu_seqlens_cpu is not None:
        fail("cu_seqlens_cpu was given without cu_seqlens")
    check_num_seqs(num_seqs, "cu_seqlens" if cu_seqlens is not None else "q")

    # States: plain [N, H, 128, 128], or pools [slots, H, 128, 128] addressed by state_indices.
    initial_state, final_state = call.initial_state, call.final_state
    pooled = call.state_indices is not None
    if pooled:
        check_slot_indices("state_indices", call.state_indices, num_seqs, device)
        if initial_state is None and final_state is None:
            fail("state_indices selects slots of a state pool: pass the pool as initial_state and/or final_state")
    rows = None if pooled else num_seqs
    init_slot = final_slot = 0
    if initial_state is not None:
        init_slot = check_state("initial_state", initial_state, heads, device, rows)
    if final_state is not None:
        final_slot = check_state("final_state", final_state, heads, device, rows)
    if call.out is not None:
        strides["out"] = check_token_tensor("out", call.out, torch.bfloat16, token_shape, device, (D, 1))
    check_status(call.status, device)
    checkpoints = check_checkpoints(call.checkpoints, num_seqs, heads, device)
    check_addresses(call)
    # Last, so every shape/dtype/value rule above is also checked (and testable) on the CPU.
    check_device(device)
    strides["beta"] = beta_stride
    init_slots, final_slots = (0 if t is None else t.shape[0] for t in (initial_state, final_state))
    return Checked(
        batch,
        seq_len,
        heads,
        num_seqs,
        scale,
        host_cu,
        seqlens_checked,
        strides,
        init_slot,
        final_slot,
        init_slots,
        final_slots,
        checkpoints,
    )
