"""Argument checks shared by the prefill and decode entry points (CPU-testable: no launch)."""

import torch

from ..layout import D

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
        fail(f"status must be a one-element torch.int32 tensor, got {status.dtype} with {status.numel()} elements; "
             f"e.g. torch.zeros(1, dtype=torch.int32, device=q.device)")
    if status.device != device:
        fail(f"status is on {status.device} but q is on {device}; move all inputs to one CUDA device")
    if status.data_ptr() % 16:
        fail("status must start on a 16-byte boundary; allocate it with torch.zeros(1, dtype=torch.int32, ...) "
             "or pass status[i, :1] of an [n, 4] int32 tensor")
