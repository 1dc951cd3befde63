"""cula-aot: ahead-of-time compiled Hopper KDA prefill and decode kernels, launched through cuda-python."""

__version__ = "0.1.0"

from .api import fwd, kda_decode, kda_prefill, preload  # noqa: E402
from .layout import STATUS_CU_SEQLENS_MALFORMED, STATUS_SLOT_OUT_OF_RANGE  # noqa: E402
from .ops.prefill import KDAInputError  # noqa: E402
from .runtime.driver import CudaError  # noqa: E402
from .runtime.manifest import ArtifactError  # noqa: E402
from . import torch_op  # noqa: E402,F401  (registers torch.ops.cula_aot.kda_prefill)

__all__ = ["ArtifactError", "CudaError", "KDAInputError", "STATUS_CU_SEQLENS_MALFORMED", "STATUS_SLOT_OUT_OF_RANGE", "fwd",
           "kda_decode", "kda_prefill", "preload"]
