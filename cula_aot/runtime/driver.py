"""Checked CUDA driver calls (cuda-bindings returns ``(CUresult, *values)`` tuples)."""

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


def zero_words(address: int, count: int, stream: int) -> None:
    """Zero ``count`` 32-bit words at device ``address``, in order on ``stream`` (a raw
    ``cudaStream_t``; capturable)."""
    check(cu.cuMemsetD32Async(address, 0, count, stream), "cuMemsetD32Async")
