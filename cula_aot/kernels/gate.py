"""The gate on the device: each variant's per-token decay γ, its constants, and what kernel code
asks of a gate at trace time.

A kernel variant is built for one gate (the ``gate`` codegen argument of K1, the fused prefill
and both decode kernels; the names and the default live host-side in ``cula_aot.gates``).
Kernel code wraps the argument once, ``gate = Gate(gate)``, and then asks the object instead of
comparing names:

* ``bounded``: "safe", γ = lower_bound·σ(e^A_log·(g + dt_bias)) ∈ [lower_bound, 0], so a product
  of T per-token decays stays a normal fp32 (lower_bound ≥ −5);
* ``defers_decay``: the decode kernels may defer the state's decay (k̂/A_t stays finite), which
  only a bounded gate allows; the unbounded ones decay the state token by token;
* ``reads_rate``: the gate reads A_log and dt_bias ("precomputed" reads neither);
* ``recomputes_constants``: the fused prefill's producers reload the constants every tile
  instead of holding them in registers across the loop (softplus);
* the γ formulas in log2 units (``tile_gamma``, ``token_log2_gamma``) and the per-CTA
  constants of the tile form (``tile_constants``).

The unbounded gates, "softplus" γ = −e^A_log·softplus(g + dt_bias) and "precomputed" γ = min(g, 0)
(the caller's log-decay), are floored at ``UNBOUNDED_GAMMA_FLOOR`` (log2 units).

``Gate`` is a ``str``: passed where a kernel took the name (a ``Constexpr[str]`` argument) it
traces and mangles exactly as the name does.
"""

import cutlass
import cutlass.cute as cute

from ..gates import DEFAULT_GATE, GATES
from .common import D, LOG2E, exp2_fast, log2_fast, sigmoid, vector

# Per-token log2-decay floor of the unbounded gates: a token that should decay by more than 2^-14
# keeps ≤ 2^-14 ≈ 6e-5 of the state it drops, a leak far below bf16's resolution (2^-8) like the
# certified pieces' 2^-20 truncation.  It bounds a tile's cumsum by 16·14 = 224, so phase C
# factors every pair around G[15]/2 (``prepare_tile.BLOCK_RANGE``) with no split paths, its
# operands within 2^±112: the range the safe gate's already span (2^±115), all normal in fp32.
UNBOUNDED_GAMMA_FLOOR = -14.0


def softplus_log2(y):
    """log2(1 + 2^y), accurate to a few fp32 ulp for every y: a short log1p series where
    2^y < 1/16 (lg2.approx's absolute error would dominate a small result), lg2(1 + 2^y) up to
    y = 24, y beyond (1 + 2^y rounds to 2^y)."""
    u = exp2_fast(y)
    series = u * (1.0 - u * (0.5 - u * (1.0 / 3.0 - u * (0.25 - u * (0.2 - u * (1.0 / 6.0))))))
    small = cutlass.Float32(series * cutlass.Float32(LOG2E))
    mid = log2_fast(cutlass.Float32(1.0) + u)
    return cutlass.Float32(cutlass.select_(y > 24.0, y, cutlass.select_(u < 0.0625, small, mid)))


class Gate(str):
    """One gate, fixed at trace time (see the module docstring)."""

    def __new__(cls, name: str = DEFAULT_GATE):
        if name not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {name!r}")
        return super().__new__(cls, name)

    @property
    def bounded(self) -> bool:
        return self == "safe"

    @property
    def defers_decay(self) -> bool:
        return self.bounded

    @property
    def reads_rate(self) -> bool:
        return self != "precomputed"

    @property
    def recomputes_constants(self) -> bool:
        return self == "softplus"

    def unbounded_gamma(self, g, gate_scale, gate_bias, rate):
        """γ in log2 units of an unbounded gate, floored at ``UNBOUNDED_GAMMA_FLOOR``: "softplus"
        −rate·log2(1 + 2^(g·gate_scale + gate_bias)) (gate_scale = log2 e, gate_bias =
        dt_bias·log2 e, rate = e^A_log), "precomputed" min(g, 0)·log2 e (g the natural log-decay)."""
        if self == "softplus":
            gamma = -rate * softplus_log2(g * gate_scale + gate_bias)
        else:
            gamma = cutlass.Float32(cutlass.min(g, cutlass.Float32(0.0)) * cutlass.Float32(LOG2E))
        return cutlass.Float32(cutlass.max(gamma, cutlass.Float32(UNBOUNDED_GAMMA_FLOOR)))

    def tile_constants(self, a_log: cute.Pointer, dt_bias: cute.Pointer, head, col0, lower_bound, columns: int):
        """The tile form's per-CTA constants for ``columns`` consecutive key columns from ``col0``:
        (gate_scale, gate_bias per column, gamma_scale).  "safe": σ(e^A_log·(g + dt_bias)) =
        1 / (1 + 2^(g·c + dt_bias·c)), c = −e^A_log·log2 e (one FFMA and two MUFU ops per
        element), gamma_scale = lower_bound·log2 e.  "softplus": the argument in log2 units
        (c = log2 e, dt_bias·log2 e) and gamma_scale = e^A_log.  "precomputed": no constants."""
        if not self.reads_rate:
            gate_scale = cutlass.Float32(LOG2E)
            gate_bias = cute.make_rmem_tensor(cute.make_layout(columns), cutlass.Float32)
            gate_bias.fill(0.0)
            gamma_scale = cutlass.Float32(1.0)
        else:
            a_value = cute.make_tensor(a_log + head, cute.make_layout(1))[0]
            if self == "softplus":
                gate_scale = cutlass.Float32(LOG2E)
            else:
                gate_scale = -cute.math.exp(a_value) * cutlass.Float32(LOG2E)
            bias = vector(dt_bias, head * D + col0, columns).load()
            gate_bias = cute.make_rmem_tensor(cute.make_layout(columns), cutlass.Float32)
            for j in range(columns):
                gate_bias[j] = bias[j] * gate_scale
            gamma_scale = cute.math.exp(a_value) if self == "softplus" else lower_bound * cutlass.Float32(LOG2E)
        return gate_scale, gate_bias, gamma_scale

    def tile_gamma(self, g, gate_scale, gate_bias: cute.Tensor, j: int, gamma_scale):
        """γ in log2 units of element ``g`` of key column ``j`` from ``tile_constants``
        (``gate_bias`` read where the formula needs it: the traced order is the formula's)."""
        if self.bounded:
            logistic = cute.arch.rcp_approx(cutlass.Float32(1.0) + exp2_fast(g * gate_scale + gate_bias[j]))
            return gamma_scale * logistic
        return self.unbounded_gamma(g, gate_scale, gate_bias[j], gamma_scale)

    def token_log2_gamma(self, g, bias: cute.Tensor, e: int, rate, lower_bound):
        """γ in log2 units of element ``g`` of key ``e``, the decode kernels' form (``rate`` =
        e^A_log, ``bias[e]`` = dt_bias of the key)."""
        if self.bounded:
            gamma = lower_bound * sigmoid(rate * (g + bias[e]))
            return gamma * cutlass.Float32(LOG2E)
        return self.unbounded_gamma(g, cutlass.Float32(LOG2E), bias[e] * cutlass.Float32(LOG2E), rate)
