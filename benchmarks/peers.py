"""Peers and ceilings measured in the benchmark's own process.

* ``copy_bandwidth``: device-to-device copy rate (bytes read + written per second), the HBM
  ceiling the prefill's unavoidable traffic is compared with.
* ``fla_runner``: flash-linear-attention's Triton ``chunk_kda`` with this project's semantics
  (gate, l2norm and β sigmoid in the kernel, ``lower_bound``, V-first states), when ``fla`` is
  importable (fla-core is a pure-Python wheel over Triton: carry it to the GPU machine).
"""

import torch

from benchmarks.timing import time_cuda


def copy_bandwidth(device, nbytes=4 << 30) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * src.numel() / (ms * 1e-3)


def prefill_bytes(x) -> int:
    """Unavoidable HBM traffic of one prefill: q, k, v, g, beta in, o out, states in and out."""
    tokens = x["q"].numel() // x["q"].shape[-1]
    return (5 * x["q"].numel() * 2 + tokens * 2) + 2 * x["s0"].numel() * 4


def fla_runner(x):
    """A no-argument call of fla's chunk_kda on inputs ``x``, or None when fla is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    heads = x["q"].shape[2]
    cu = None if x["cu"] is None else x["cu"].long()

    def run():
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"], output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"].reshape(heads * 128),
                  state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=None if cu is None else x["cu_cpu"].long())

    return run
