"""Checked CUDA driver calls (cuda-bindings returns ``(CUresult, *values)`` tuples), and the one
hot call made without it.

``launch_kernel`` is ``cuLaunchKernel`` called straight into the driver library through ctypes:
the kernels' parameters are already one packed buffer, and cuda-bindings' argument handling
costs several microseconds per launch, which a serving loop pays on every layer.  Everything
else (loading, attributes, TMA encoding, errors) goes through cuda-bindings.
"""

import ctypes
import functools

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message carries ``cuGetErrorName``."""


def check(result, what: str):
    """Unwrap a cuda-bindings ``(CUresult, *values)`` tuple, raising ``CudaError`` on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise CudaError(f"{what} failed: {name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.lru_cache(maxsize=1)
def _driver_launch():
    """``cuLaunchKernel`` from the driver library the process already uses, or None."""
    try:
        function = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    uint = ctypes.c_uint
    function.argtypes = [ctypes.c_void_p, uint, uint, uint, uint, uint, uint, uint, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def launch_kernel(function: int, grid: tuple, block: tuple, smem: int, stream: int, extra: int, what: str) -> None:
    """Launch ``function`` (a raw CUfunction) with a ``CU_LAUNCH_PARAM_*`` ``extra`` array."""
    direct = _driver_launch()
    if direct is None:
        check(cu.cuLaunchKernel(function, *grid, *block, smem, cu.CUstream(stream), 0, extra), what)
        return
    status = direct(function, *grid, *block, smem, stream, None, extra)
    if status:
        check(cu.CUresult(status), what)
