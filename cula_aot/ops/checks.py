"""Argument checks shared by the prefill and decode entry points (CPU-testable: no launch)."""

import torch

from ..layout import FLAG_BETA_PROBABILITY, FLAG_QK_AS_GIVEN, D
from ..specs import GATES

DEFAULT_SCALE = D**-0.5


class KDAInputError(ValueError):
    """A cula_aot call's argument is invalid; the message names it and the fix."""


def fail(message: str):
    raise KDAInputError(message)


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


def check_scalars(lower_bound, scale) -> tuple[float, float]:
    """``(lower_bound, scale)`` as floats: lower_bound in [-5, 0), scale finite (None: 128^-0.5)."""
    lower_bound = float(lower_bound)
    if not -5.0 <= lower_bound < 0.0:
        fail(f"lower_bound must be in [-5, 0), got {lower_bound}")
    scale = DEFAULT_SCALE if scale is None else float(scale)
    if not (scale == scale and abs(scale) != float("inf")):
        fail(f"scale must be a finite number, got {scale}")
    return lower_bound, scale


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


# A placeholder lower bound for the unbounded gates: their kernels never read it, and it lets one
# scalar check serve every gate.
UNUSED_LOWER_BOUND = -1.0
_DEVICE_CONSTANTS: dict = {}


def device_constant(key: tuple, device, make):
    """``make()``'s tensors, made once per ``(key, device)`` and reused; not kept while a CUDA
    graph is being captured (the fill would run only at replay, and the memory is the graph's)."""
    full_key = (*key, device)
    if full_key in _DEVICE_CONSTANTS:
        return _DEVICE_CONSTANTS[full_key]
    value = make()
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _DEVICE_CONSTANTS[full_key] = value
    return value


def gate_defaults(heads: int, device):
    """fla's defaults for a missing A_log (unit scale: e^0) and dt_bias (0), one pair per device
    and head count."""
    return device_constant(
        ("gate_defaults", heads),
        device,
        lambda: (
            torch.zeros(heads, dtype=torch.float32, device=device),
            torch.zeros(heads, D, dtype=torch.float32, device=device),
        ),
    )


def input_flags(beta_sigmoid, qk_l2norm) -> int:
    """The kernels' input-convention bits (``layout.FLAG_BETA_PROBABILITY``, ``FLAG_QK_AS_GIVEN``):
    ``beta_sigmoid`` True takes β as logits (b = σ(β)), False as the probabilities b themselves;
    ``qk_l2norm`` True L2-normalises q and k in the kernel, False uses them as given."""
    for name, value in (("beta_sigmoid", beta_sigmoid), ("qk_l2norm", qk_l2norm)):
        if type(value) is not bool:
            fail(f"{name} must be True or False, got {value!r}")
    return (0 if beta_sigmoid else FLAG_BETA_PROBABILITY) | (0 if qk_l2norm else FLAG_QK_AS_GIVEN)


def kernel_dtypes(g, beta) -> tuple:
    """g and β as the kernels read them: fp32 ones (as fla's callers pass a precomputed gate and
    β probabilities) rounded to bf16 first, one elementwise pass each; anything else as given
    (validation names a wrong dtype)."""
    return tuple(
        t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in (g, beta)
    )


def gate_inputs(gate, A_log, dt_bias, lower_bound, q) -> tuple:
    """``(A_log, dt_bias, lower_bound)`` the kernels of ``gate`` take (``specs.GATES``):
    "safe" passes them through (checked with the other inputs); "softplus" takes A_log and dt_bias
    or fla's defaults for None and refuses a lower_bound; "precomputed" (g is the log-decay)
    refuses all three."""
    if gate not in GATES:
        fail(f"gate must be one of {', '.join(map(repr, GATES))}, got {gate!r}")
    if gate == "safe":
        if lower_bound is None:
            fail("gate='safe' needs lower_bound (in [-5, 0)); for fla's unbounded gate pass gate='softplus'")
        return A_log, dt_bias, lower_bound
    if lower_bound is not None:
        fail(f"lower_bound applies to gate='safe' only; gate={gate!r} is unbounded: pass lower_bound=None")
    if gate == "precomputed" and (A_log is not None or dt_bias is not None):
        fail("gate='precomputed' takes g as the log-decay itself: pass A_log=None and dt_bias=None")
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        return A_log, dt_bias, UNUSED_LOWER_BOUND  # validation names the bad q
    zeros_a, zeros_dt = gate_defaults(q.shape[-2], q.device)
    return (zeros_a if A_log is None else A_log, zeros_dt if dt_bias is None else dt_bias, UNUSED_LOWER_BOUND)


def call_inputs(gate, A_log, dt_bias, lower_bound, q, g, beta, beta_sigmoid, qk_l2norm) -> tuple:
    """What every entry point resolves before validation: ``(A_log, dt_bias, lower_bound)`` of
    ``gate`` (``gate_inputs``), g and β in the kernels' dtype (``kernel_dtypes``) and the
    input-convention bits (``input_flags``), as ``(A_log, dt_bias, lower_bound, g, beta, flags)``."""
    A_log, dt_bias, lower_bound = gate_inputs(gate, A_log, dt_bias, lower_bound, q)
    g, beta = kernel_dtypes(g, beta)
    return A_log, dt_bias, lower_bound, g, beta, input_flags(beta_sigmoid, qk_l2norm)
