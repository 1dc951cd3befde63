"""The argument rules prefill, decode and the distributed prefill share, one validator per concept
(CPU-testable: nothing here launches): tensors of a dtype and shape, the scalars, the status word,
a state (plain rows or a pool), a pool's slot indices, and cu_seqlens (its structure and its host
values).  Each raises ``KDAInputError`` naming the argument and the fix."""

import torch

from ..errors import KDAInputError, fail  # noqa: F401 (KDAInputError: re-exported)
from ..layout import FLAG_BETA_PROBABILITY, FLAG_QK_AS_GIVEN, MAX_SEQS, D

DEFAULT_SCALE = D**-0.5
STATE_LAYOUTS = ("vk", "kv")
STATE_DTYPES = (torch.float32, torch.bfloat16)
INT32_MAX = 2**31 - 1


def check_num_seqs(num_seqs: int, what: str) -> None:
    """The sequences of one call fit the grid (every kernel puts them on its z axis)."""
    if num_seqs > MAX_SEQS:
        fail(f"{what} has {num_seqs} sequences; one call runs at most {MAX_SEQS}: split the batch into calls")


def check_dtype_shape(name, t, dtype, shape, device) -> None:
    """``t`` is a tensor of ``dtype`` and ``shape`` on ``device`` (q's device)."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        fail(f"{name} must be {dtype}, got {t.dtype}; convert it with {name}.to({dtype})")
    if tuple(t.shape) != tuple(shape):
        fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        fail(f"{name} is on {t.device} but q is on {device}; move all inputs to one CUDA device")


def check_contiguous(name, t, dtype, shape, device) -> None:
    """``check_dtype_shape`` and contiguous."""
    check_dtype_shape(name, t, dtype, shape, device)
    if not t.is_contiguous():
        fail(f"{name} must be contiguous; call {name}.contiguous()")


def check_scalars(lower_bound, scale) -> tuple[float, float]:
    """``(lower_bound, scale)`` as floats: lower_bound in [-5, 0), scale finite (None: 128^-0.5)."""
    lower_bound = float(lower_bound)
    if not -5.0 <= lower_bound < 0.0:
        fail(f"lower_bound must be in [-5, 0), got {lower_bound}")
    scale = DEFAULT_SCALE if scale is None else float(scale)
    if not (scale == scale and abs(scale) != float("inf")):
        fail(f"scale must be a finite number, got {scale}")
    return lower_bound, scale


def check_state_layout(state_layout) -> None:
    if state_layout not in STATE_LAYOUTS:
        fail(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")


def check_status(status, device) -> None:
    """The optional status word: one int32 on q's device, 16-byte aligned (the kernels OR
    ``layout.STATUS_*`` bits into it and never clear it)."""
    if status is None:
        return
    if not isinstance(status, torch.Tensor):
        fail(f"status must be a torch.Tensor, got {type(status).__name__}")
    if status.dtype != torch.int32 or status.numel() != 1:
        fail(
            f"status must be a one-element torch.int32 tensor, got {status.dtype} with {status.numel()} elements; "
            f"e.g. torch.zeros(1, dtype=torch.int32, device=q.device)"
        )
    if status.device != device:
        fail(f"status is on {status.device} but q is on {device}; move all inputs to one CUDA device")
    if status.data_ptr() % 16:
        fail(
            "status must start on a 16-byte boundary; allocate it with torch.zeros(1, dtype=torch.int32, ...) "
            "or pass status[i, :1] of an [n, 4] int32 tensor"
        )


def check_state(name, t, heads: int, device, rows: int | None = None, kernel_read: bool = True) -> int | None:
    """A state tensor in fp32 or bf16: ``rows`` plain rows ``[N, H, 128, 128]`` (one per
    sequence), or with ``rows`` None a pool ``[slots >= 1, H, 128, 128]`` whose slots may be
    padded apart.  Read by a kernel (``kernel_read``): contiguous within a slot, slots 16-byte
    aligned and not overlapping, and the slot stride in elements is returned (its base address is
    a per-call rule); otherwise (the distributed prefill moves states with torch) any strides."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in STATE_DTYPES:
        fail(f"{name} must be torch.float32 or torch.bfloat16, got {t.dtype}; convert it with {name}.float()")
    if rows is None:
        want, ok = f"[slots >= 1, {heads}, {D}, {D}] (a pool)", t.dim() == 4 and t.shape[0] >= 1
    else:
        want, ok = f"[{rows}, {heads}, {D}, {D}] (one state per sequence)", t.dim() == 4 and t.shape[0] == rows
    if not ok or tuple(t.shape[1:]) != (heads, D, D):
        fail(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        fail(f"{name} is on {t.device} but q is on {device}; move all inputs to one CUDA device")
    if not kernel_read:
        return None
    slot = heads * D * D
    strides = t.stride()
    if strides[2:] != (D, 1) or (heads > 1 and strides[1] != D * D):
        fail(
            f"{name} must be contiguous within a slot (strides [*, {D * D}, {D}, 1]), got strides "
            f"{list(strides)}: only the slot stride may be padded; call {name}.contiguous()"
        )
    stride = strides[0] if t.shape[0] > 1 else slot
    if stride < slot:
        fail(f"{name}'s slot stride {stride} is smaller than one slot's {slot} elements (overlapping states)")
    if stride * t.element_size() % 16:
        fail(f"{name}'s slot stride {stride} elements must be a multiple of 16 bytes")
    if stride > INT32_MAX or t.shape[0] > INT32_MAX:
        fail(f"{name}'s slot stride {stride} and slot count {t.shape[0]} must fit in int32")
    return stride


def check_slot_indices(name, t, num_seqs: int, device, tokens: int | None = None) -> None:
    """A pool's slot per sequence: int32 ``[num_seqs]``, contiguous, or with ``tokens`` a slot per
    token (vLLM's speculative ``ssm_state_indices``): ``[num_seqs, tokens]`` with contiguous rows;
    on q's device (never read by the host; an entry outside the pool is padding, or not written)."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        fail(f"{name} must be torch.int32, got {t.dtype}; convert it with {name}.to(torch.int32)")
    if tokens is None:
        if tuple(t.shape) != (num_seqs,):
            fail(f"{name} must have shape [{num_seqs}] (one pool slot per sequence, -1 for none), got {list(t.shape)}")
        if num_seqs > 1 and t.stride(0) != 1:
            fail(f"{name} must be contiguous; call {name}.contiguous()")
    else:
        if tuple(t.shape) != (num_seqs, tokens):
            fail(
                f"{name} of two dims holds a pool slot per token: shape [{num_seqs}, {tokens}] (N, T), "
                f"got {list(t.shape)}"
            )
        if (tokens > 1 and t.stride(1) != 1) or (num_seqs > 1 and t.stride(0) != tokens):
            fail(
                f"{name} [N, T] must be contiguous (strides [{tokens}, 1]), got {list(t.stride())}; "
                f"call {name}.contiguous()"
            )
    if t.device != device:
        fail(f"{name} is on {t.device} but q is on {device}; keep it on the GPU (it is never read on the host)")


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, batch: int, device) -> int:
    """cu_seqlens' structure (its values: ``host_cu_seqlens``): int32/int64 ``[N + 1]`` on q's
    device or the CPU, with B = 1; ``cu_seqlens_cpu`` as many entries.  Returns N."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail("cu_seqlens must be an int32 or int64 tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        fail(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device not in (device, torch.device("cpu")):
        fail(f"cu_seqlens is on {cu_seqlens.device}; put it on {device} (or the CPU)")
    if batch != 1:
        fail(f"varlen input (cu_seqlens) needs batch size 1, got B = {batch}; flatten to [1, total, H, {D}]")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.numel() != cu_seqlens.numel():
        fail(f"cu_seqlens_cpu has {cu_seqlens_cpu.numel()} entries but cu_seqlens has {cu_seqlens.numel()}")
    return cu_seqlens.numel() - 1


def host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens: int) -> list[int]:
    """cu_seqlens' values read on the host (``cu_seqlens_cpu`` when given, else cu_seqlens: a sync
    for a device tensor, refused under capture) and checked: from 0, increasing, ending at T."""
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
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


def read_host_cu(cu_seqlens, cu_seqlens_cpu, checked: bool, total_tokens: int) -> list[int] | None:
    """The host cu_seqlens values: checked (``host_cu_seqlens``) when ``checked``, else read
    unchecked from ``cu_seqlens_cpu`` when given (free to read; CP planning uses it), else None."""
    if checked:
        return host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens)
    return None if cu_seqlens_cpu is None else [int(x) for x in cu_seqlens_cpu.tolist()]


def check_device(device) -> None:
    """Last of every validation, so that every other rule is checked (and testable) on the CPU."""
    if device.type != "cuda":
        fail(f"inputs are on {device}: cula_aot runs on CUDA (sm_90a) devices only; move them with .cuda()")


def input_flags(beta_sigmoid, qk_l2norm) -> int:
    """The kernels' input-convention bits (``layout.FLAG_BETA_PROBABILITY``, ``FLAG_QK_AS_GIVEN``):
    ``beta_sigmoid`` True takes β as logits (b = σ(β)), False as the probabilities b themselves;
    ``qk_l2norm`` True L2-normalises q and k in the kernel, False uses them as given."""
    if beta_sigmoid is True and qk_l2norm is True:  # the default conventions, in one test
        return 0
    for name, value in (("beta_sigmoid", beta_sigmoid), ("qk_l2norm", qk_l2norm)):
        if type(value) is not bool:
            fail(f"{name} must be True or False, got {value!r}")
    return (0 if beta_sigmoid else FLAG_BETA_PROBABILITY) | (0 if qk_l2norm else FLAG_QK_AS_GIVEN)


def kernel_dtypes(g, beta) -> tuple:
    """g and β as the kernels read them: fp32 ones (as fla's callers pass a precomputed gate and
    β probabilities) rounded to bf16 first, one elementwise pass each; anything else as given
    (validation names a wrong dtype)."""
    if isinstance(g, torch.Tensor) and g.dtype is torch.float32:
        g = g.to(torch.bfloat16)
    if isinstance(beta, torch.Tensor) and beta.dtype is torch.float32:
        beta = beta.to(torch.bfloat16)
    return g, beta
