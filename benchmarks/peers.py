"""Peers and ceilings measured in the benchmark's own process.

* ``copy_bandwidth``: device-to-device copy rate (bytes read + written per second), the HBM
  ceiling the prefill's unavoidable traffic is compared with.
* ``fla_runner``: flash-linear-attention's Triton ``chunk_kda`` with this project's semantics
  (gate ``lower_bound·σ(exp(A_log)·(g + dt_bias))`` with ``safe_gate``, or fla's softplus gate, q/k l2norm and β sigmoid
  in the kernel, V-first ``[N, H, V, K]`` fp32 states), when ``fla`` is importable (fla-core is
  a pure-Python wheel over Triton: carry it to the GPU machine).  It is only called, never copied.
"""

import os

import torch

from benchmarks.timing import time_cuda

# fla dispatches chunk_kda to the FlashKDA CUTLASS backend when that package is installed and
# autograd is off; the peer measured here is fla's own Triton path.
os.environ.setdefault("FLA_FLASH_KDA", "0")


def copy_bandwidth(device, nbytes=4 << 30) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    buffers = [torch.empty(nbytes // 2, dtype=torch.uint8, device=device) for _ in range(2)]

    def copy():
        buffers[1].copy_(buffers[0])

    ms = time_cuda(copy, warmup=3, iters=20)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * (nbytes // 2) / (ms * 1e-3)


def prefill_bytes(x) -> int:
    """Unavoidable HBM traffic of one prefill: q, k, v, g in and o out (bf16), beta in (bf16),
    the fp32 states in and out."""
    elems = x["q"].numel()
    tokens_heads = elems // x["q"].shape[-1]
    return 5 * elems * 2 + tokens_heads * 2 + 2 * x["s0"].numel() * 4


def fla_version():
    """fla's version string, or None when it is not importable."""
    try:
        import fla
        from fla.ops.kda import chunk_kda  # noqa: F401
    except ImportError:
        return None
    return getattr(fla, "__version__", "unknown")


def fla_runner(x, lower_bound=-5.0):
    """A no-argument call of fla's chunk_kda on inputs ``x`` returning ``(o, final_state)``, or
    None when fla is not installed; ``lower_bound`` None: fla's unbounded softplus gate."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    heads = x["q"].shape[2]
    cu = None if x["cu"] is None else x["cu"].long()
    cu_cpu = None if cu is None else x["cu_cpu"].long()
    dt_bias = x["dt_bias"].reshape(heads * 128)

    def run():
        with torch.no_grad():
            return chunk_kda(
                x["q"],
                x["k"],
                x["v"],
                x["g"],
                x["beta"],
                initial_state=x["s0"],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                safe_gate=lower_bound is not None,
                lower_bound=lower_bound,
                A_log=x["A_log"],
                dt_bias=dt_bias,
                state_v_first=True,
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
            )

    return run
