"""cula-aot: ahead-of-time compiled Hopper KDA prefill and decode kernels, launched through cuda-python."""

from ._version import __version__  # noqa: F401
from .api import fwd, kda_decode, kda_decode_layer, kda_prefill, preload
from .drafts import Drafts, draft_buffers
from .ops.decode_layer import DecodeLayerStep
from .layout import (
    STATUS_CHECKPOINT_MISALIGNED,
    STATUS_CU_SEQLENS_MALFORMED,
    STATUS_DRAFT_OUT_OF_RANGE,
    STATUS_SLOT_OUT_OF_RANGE,
)
from .errors import KDAInputError
from .runtime.driver import CudaError
from .runtime.manifest import ArtifactError
from . import torch_op  # noqa: F401  (registers torch.ops.cula_aot.kda_prefill)

__all__ = [
    "ArtifactError",
    "CudaError",
    "DecodeLayerStep",
    "Drafts",
    "KDAInputError",
    "STATUS_CHECKPOINT_MISALIGNED",
    "STATUS_CU_SEQLENS_MALFORMED",
    "STATUS_DRAFT_OUT_OF_RANGE",
    "STATUS_SLOT_OUT_OF_RANGE",
    "fwd",
    "draft_buffers",
    "kda_decode",
    "kda_decode_layer",
    "kda_prefill",
    "preload",
]
