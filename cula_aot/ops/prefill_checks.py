"""The prefill's argument validation (CPU-testable: nothing here launches).

``validate`` checks every argument of a ``prefill`` call before anything launches and derives the
facts a plan is built from (``Checked``); the device rule comes last, so every other rule is
testable on the CPU.  ``_host_cu_seqlens`` / ``_read_host_cu`` read (and check) host cu_seqlens
values, for ``validate`` and for the cached plans' per-call checks alike.
"""

import dataclasses

import torch

from ..layout import CHUNK, D, FLAG_BF16_CHECKPOINT, FLAG_CHECKPOINT_OFFSETS
from .checks import check_dtype_shape, check_scalars, check_status, fail

STATE_LAYOUTS = ("vk", "kv")
STATE_DTYPES = (torch.float32, torch.bfloat16)
SEQLEN_CHECKS = ("auto", "host", "off")


def _check_tensor(name, t, dtype, shape, device):
    check_dtype_shape(name, t, dtype, shape, device)
    if not t.is_contiguous():
        fail(f"{name} must be contiguous; call {name}.contiguous()")


def _check_token_tensor(name, t, dtype, shape, device, packed: tuple, aligned_rows: bool = True) -> int:
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


def _check_state(name, t, leading: int, leading_what: str, heads: int, device) -> int:
    """A state tensor ``[leading, H, 128, 128]`` in fp32 or bf16 whose slots may be padded apart
    (a state pool); returns its slot stride in elements."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in STATE_DTYPES:
        fail(f"{name} must be torch.float32 or torch.bfloat16, got {t.dtype}; convert it with {name}.float()")
    if t.dim() != 4 or tuple(t.shape[1:]) != (heads, D, D) or (leading >= 0 and t.shape[0] != leading):
        want = [leading if leading >= 0 else leading_what, heads, D, D]
        fail(f"{name} must have shape {want} ({leading_what}), got {list(t.shape)}")
    if t.device != device:
        fail(f"{name} is on {t.device} but q is on {device}; move all inputs to one CUDA device")
    slot = D * D * heads
    strides = t.stride()
    if strides[2:] != (D, 1) or (heads > 1 and strides[1] != D * D):
        fail(
            f"{name} must be packed within each state (strides [*, {D * D}, {D}, 1]), got strides "
            f"{list(strides)}; call {name}.contiguous()"
        )
    stride = strides[0] if t.shape[0] > 1 else slot
    if stride < slot:
        fail(f"{name}'s slot stride {stride} is smaller than one slot's {slot} elements (overlapping states)")
    if stride * t.element_size() % 16:
        fail(f"{name} must have 16-byte aligned slots (slot stride {stride})")
    if stride >= 2**31:
        fail(f"{name}'s slot stride {stride} does not fit in int32")
    return stride


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


def check_checkpoints(every, pool, indices, offsets, num_seqs: int, heads: int, device) -> CheckpointPlan:
    """``kda_prefill``'s checkpoint arguments (see its docstring): all or none of every, pool and
    indices; the pool a state pool like ``initial_state``'s, indices int32 ``[N, M]`` and offsets
    int32 ``[N]``, both contiguous on q's device."""
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
    slot_stride = _check_state("checkpoint_pool", pool, -1, "pool slots", heads, device)
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
    _check_tensor("checkpoint_indices", indices, torch.int32, tuple(indices.shape), device)
    if indices.numel() >= 2**31:
        fail(f"checkpoint_indices has {indices.numel()} entries; at most 2**31 - 1 fit the kernels' int32 index")
    flags = FLAG_BF16_CHECKPOINT if pool.dtype == torch.bfloat16 else 0
    if offsets is not None:
        _check_tensor("checkpoint_offsets", offsets, torch.int32, (num_seqs,), device)
        flags |= FLAG_CHECKPOINT_OFFSETS
    return CheckpointPlan(every, indices.shape[1], pool.shape[0], slot_stride, flags)


def _check_device(device) -> None:
    if device.type != "cuda":
        fail(f"inputs are on {device}: cula_aot runs on CUDA (sm_90a) devices only; move them with .cuda()")


def _check_addresses(
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
    state_indices,
    status=None,
    checkpoints=(None, None, None),
) -> None:
    """Per-call rules on addresses: 16-byte aligned bases (the kernels' pointer and TMA
    assumption) and outputs that do not alias an input.  ``checkpoints``: (pool, indices,
    offsets)."""
    named = {
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "initial_state": initial_state,
        "final_state": final_state,
        "out": out,
        "state_indices": state_indices,
        "status": status,
        **dict(zip(("checkpoint_pool", "checkpoint_indices", "checkpoint_offsets"), checkpoints)),
    }
    for name, t in named.items():
        if t is not None and t.data_ptr() % 16:
            fail(f"{name} must start on a 16-byte boundary (its storage offset breaks it); call {name}.clone()")
    inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr())
    for name, t in (("out", out), ("final_state", final_state), ("checkpoint_pool", checkpoints[0])):
        if t is not None and t.data_ptr() in inputs:
            fail(f"{name} must not alias an input tensor")


def _read_host_cu(cu_seqlens, cu_seqlens_cpu, checked: bool, total_tokens: int) -> list[int] | None:
    """The host cu_seqlens values: checked (``_host_cu_seqlens``) when ``checked``, else read
    unchecked from ``cu_seqlens_cpu`` when given (free to read; CP planning uses it), else None."""
    if checked:
        return _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens)
    return None if cu_seqlens_cpu is None else [int(x) for x in cu_seqlens_cpu.tolist()]


def _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens: int) -> list[int]:
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    # Here for validate and for the cached plans' per-call checks alike.
    if source.is_cuda and torch.cuda.is_current_stream_capturing():
        fail(
            "check_seqlens='host' copies a device cu_seqlens to the host, which CUDA-graph capture forbids; "
            "pass cu_seqlens_cpu, or check_seqlens='off'"
        )
    values = [int(x) for x in source.tolist()]
    if cu_seqlens_cpu is not None and cu_seqlens.numel() != len(values):
        fail(f"cu_seqlens_cpu has {len(values)} entries but cu_seqlens has {cu_seqlens.numel()}")
    if values[0] != 0:
        fail(f"cu_seqlens must start at 0, got {values[0]}")
    for n, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            fail(f"cu_seqlens must be non-decreasing: cu_seqlens[{n + 1}] = {b} < cu_seqlens[{n}] = {a}")
        if b == a:
            fail(f"cu_seqlens describes an empty sequence {n} ({a}..{b}); drop empty sequences")
    if values[-1] != total_tokens:
        fail(f"cu_seqlens must end at T = {total_tokens} (q.shape[1]), got {values[-1]}")
    return values


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
        return True  # a device cu_seqlens is read (a sync) by _host_cu_seqlens, which refuses it under capture
    return cu_seqlens_cpu is not None or not cu_seqlens.is_cuda  # "auto": only when it costs no sync


def validate(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale,
    initial_state,
    cu_seqlens,
    cu_seqlens_cpu,
    state_layout,
    out,
    final_state,
    intracard_cp="auto",
    state_indices=None,
    check_seqlens="auto",
    status=None,
    checkpoint_every=0,
    checkpoint_pool=None,
    checkpoint_indices=None,
    checkpoint_offsets=None,
) -> Checked:
    """Check every argument before anything launches (the device rule last, so every other rule
    is testable on the CPU)."""
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
        name: _check_token_tensor(name, t, torch.bfloat16, token_shape, device, (D, 1))
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g))
    }
    beta_stride = _check_token_tensor(
        "beta", beta, torch.bfloat16, (batch, seq_len, heads), device, (1,), aligned_rows=False
    )
    _check_tensor("A_log", A_log, torch.float32, (heads,), device)
    _check_tensor("dt_bias", dt_bias, torch.float32, (heads, D), device)
    lower_bound, scale = check_scalars(lower_bound, scale)
    if state_layout not in STATE_LAYOUTS:
        fail(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if check_seqlens not in SEQLEN_CHECKS:
        fail(f"check_seqlens must be one of {SEQLEN_CHECKS}, got {check_seqlens!r}")

    # Identity tests: 0 == False and 1 == True, but 0 is no s_split.
    if not (
        intracard_cp is True
        or intracard_cp is False
        or (isinstance(intracard_cp, str) and intracard_cp == "auto")
        or (type(intracard_cp) is int and intracard_cp >= 1)
    ):
        fail(f"intracard_cp must be 'auto', True, False or an int s_split >= 1, got {intracard_cp!r}")

    num_seqs = batch
    host_cu = None
    seqlens_checked = False
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            fail("cu_seqlens must be an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            fail(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
        if cu_seqlens.device not in (device, torch.device("cpu")):
            fail(f"cu_seqlens is on {cu_seqlens.device}; put it on {device} (or the CPU)")
        if batch != 1:
            fail(f"varlen input (cu_seqlens) needs batch size 1, got B = {batch}; flatten to [1, total, H, {D}]")
        num_seqs = cu_seqlens.numel() - 1
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.numel() != cu_seqlens.numel():
            fail(f"cu_seqlens_cpu has {cu_seqlens_cpu.numel()} entries but cu_seqlens has {cu_seqlens.numel()}")
        seqlens_checked = _check_seqlens_choice(check_seqlens, cu_seqlens, cu_seqlens_cpu)
        host_cu = _read_host_cu(cu_seqlens, cu_seqlens_cpu, seqlens_checked, seq_len)
    elif cu_seqlens_cpu is not None:
        fail("cu_seqlens_cpu was given without cu_seqlens")

    # States: plain [N, H, 128, 128], or pools [slots, H, 128, 128] addressed by state_indices.
    if state_indices is not None:
        _check_tensor("state_indices", state_indices, torch.int32, (num_seqs,), device)
        if initial_state is None and final_state is None:
            fail("state_indices selects slots of a state pool: pass the pool as initial_state and/or final_state")
    leading, leading_what = (-1, "pool slots") if state_indices is not None else (num_seqs, "N sequences")
    init_slot = final_slot = 0
    if initial_state is not None:
        init_slot = _check_state("initial_state", initial_state, leading, leading_what, heads, device)
    if final_state is not None:
        final_slot = _check_state("final_state", final_state, leading, leading_what, heads, device)
    if out is not None:
        out_stride = _check_token_tensor("out", out, torch.bfloat16, token_shape, device, (D, 1))
    check_status(status, device)
    checkpoints = check_checkpoints(
        checkpoint_every, checkpoint_pool, checkpoint_indices, checkpoint_offsets, num_seqs, heads, device
    )
    _check_addresses(
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
        state_indices,
        status,
        (checkpoint_pool, checkpoint_indices, checkpoint_offsets),
    )
    # Last, so every shape/dtype/value rule above is also checked (and testable) on the CPU.
    _check_device(device)
    strides["beta"] = beta_stride
    if out is not None:
        strides["out"] = out_stride
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
