"""Small device tensors made once per (key, device) and reused across calls."""

import torch

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
