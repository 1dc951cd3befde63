"""The gate's host-side home: its names and default (this module grows the argument resolution
and the float64 reference formula)."""

# The per-token decay a kernel variant computes (a codegen argument of K1, the fused prefill and
# decode; K2, the CP kernels and the merge read only the decays K1 wrote): "safe"
# γ = lower_bound·σ(e^A_log·(g + dt_bias)), "softplus" γ = −e^A_log·softplus(g + dt_bias) and
# "precomputed" γ = g (the caller's log-decay).  The last two are unbounded.
GATES = ("safe", "softplus", "precomputed")
DEFAULT_GATE = "safe"
