"""The gate's host-side home: its names and default, how a call's gate arguments resolve (fla's
flags included), and the float64 formula the reference and the tests hold the kernels to.  The
device side (each gate's γ in the kernels, a codegen argument) lives in ``kernels``.

Every gate runs from the wheel, chosen per call:

* "safe": γ = lower_bound·σ(e^A_log·(g + dt_bias)); A_log fp32 ``[H]``, dt_bias fp32 ``[H, 128]``
  and lower_bound in [-5, 0) required (Kimi-K3, GLM-5.3-Flash, Ling-3.0).
* "softplus": γ = −e^A_log·softplus(g + dt_bias), unbounded (fla's default, Kimi Linear's); A_log
  None means e^A_log = 1, dt_bias None means 0; no lower_bound.
* "precomputed": g is γ itself (the natural log-decay, ≤ 0); no A_log, dt_bias or lower_bound.

K1, the fused prefill and decode compile one variant per gate; K2, the CP kernels and the merge
read only the decays K1 wrote.
"""

from typing import NamedTuple

import torch

from .constants import device_constant
from .errors import fail
from .layout import D

GATES = ("safe", "softplus", "precomputed")
DEFAULT_GATE = "safe"
# The unbounded gates' kernels never read a lower bound: this placeholder lets one scalar check
# serve every gate.
UNUSED_LOWER_BOUND = -1.0


def bounded(gate: str) -> bool:
    """Whether ``gate``'s per-token decay is bounded below (the safe gate: γ ≥ lower_bound ≥ −5, so
    a 16-token tile's e^±G stay in range); the unbounded gates need each pair's decay factored."""
    return gate == "safe"


class GateArgs(NamedTuple):
    """A call's gate as the kernels take it: the gate's name, A_log fp32 ``[H]``, dt_bias fp32
    ``[H, 128]`` (zeros where the gate reads none) and lower_bound (``UNUSED_LOWER_BOUND`` for the
    unbounded gates)."""

    name: str
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    lower_bound: float


def gate_defaults(heads: int, device):
    """fla's defaults for a missing A_log (unit scale: e^0) and dt_bias (0), made once per device
    and head count."""
    return device_constant(
        ("gate_defaults", heads),
        device,
        lambda: (
            torch.zeros(heads, dtype=torch.float32, device=device),
            torch.zeros(heads, D, dtype=torch.float32, device=device),
        ),
    )


def resolve_gate(gate, A_log, dt_bias, lower_bound, q) -> GateArgs:
    """``gate``'s arguments as the kernels take them: "safe" passes them through (validation checks
    them with the other inputs); "softplus" takes A_log and dt_bias or fla's defaults for None and
    refuses a lower_bound; "precomputed" refuses all three.  ``q`` gives the head count and device
    of the defaults (a bad q is named by validation)."""
    if gate not in GATES:
        fail(f"gate must be one of {', '.join(map(repr, GATES))}, got {gate!r}")
    if gate == "safe":
        if lower_bound is None:
            fail("gate='safe' needs lower_bound (in [-5, 0)); for fla's unbounded gate pass gate='softplus'")
        # tuple.__new__: the generated NamedTuple constructor costs a Python frame (decode calls this per call).
        return tuple.__new__(GateArgs, (gate, A_log, dt_bias, lower_bound))
    if lower_bound is not None:
        fail(f"lower_bound applies to gate='safe' only; gate={gate!r} is unbounded: pass lower_bound=None")
    if gate == "precomputed" and (A_log is not None or dt_bias is not None):
        fail("gate='precomputed' takes g as the log-decay itself: pass A_log=None and dt_bias=None")
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        return GateArgs(gate, A_log, dt_bias, UNUSED_LOWER_BOUND)
    zeros_a, zeros_dt = gate_defaults(q.shape[-2], q.device)
    return GateArgs(
        gate, zeros_a if A_log is None else A_log, zeros_dt if dt_bias is None else dt_bias, UNUSED_LOWER_BOUND
    )


def fla_gate(use_gate_in_kernel, safe_gate, lower_bound, A_log, dt_bias, heads, device) -> dict:
    """``kda_prefill``'s gate arguments for fla's flags: ``use_gate_in_kernel=False`` is
    "precomputed", ``safe_gate`` (or, in fla's recurrent entry, a lower_bound) "safe", otherwise
    "softplus"; fla's A_log and dt_bias of any float dtype and shape ``[H·128]`` are taken as fp32
    ``[H]`` / ``[H, 128]``, and fla's defaults (``gate_defaults``) stand in for None under both
    in-kernel gates."""
    if not use_gate_in_kernel:
        return {"gate": "precomputed"}
    problem = fla_gate_problem(use_gate_in_kernel, safe_gate, lower_bound)
    if problem:
        fail(problem)
    zeros_a, zeros_dt = gate_defaults(heads, device)
    a_log = zeros_a if A_log is None else A_log.float()
    bias = zeros_dt if dt_bias is None else dt_bias.float().reshape(heads, -1)
    if safe_gate:
        return {"gate": "safe", "A_log": a_log, "dt_bias": bias, "lower_bound": lower_bound}
    return {"gate": "softplus", "A_log": a_log, "dt_bias": bias}


def fla_gate_problem(use_gate_in_kernel, safe_gate, lower_bound) -> str | None:
    """Why fla's gate flags name no gate (``fla_gate`` raises it; fla's backend verifier declines
    with it), or None."""
    if use_gate_in_kernel and safe_gate and lower_bound is None:
        return "safe_gate=True needs a lower_bound (in [-5, 0))"
    return None


def log_decay(g, A_log, dt_bias, lower_bound, kind=DEFAULT_GATE):
    """Per-token log-decay γ in float64, like g ``[B, T, H, K]`` (bf16/fp32), by gate ``kind``:
    "safe" ``lower_bound · σ(exp(A_log)[h] · (g + dt_bias[h]))``; "softplus"
    ``−exp(A_log)[h] · softplus(g + dt_bias[h])`` (A_log None: exp(A_log) = 1; dt_bias None: 0;
    lower_bound unused); "precomputed" ``min(g, 0)``."""
    x = g.to(torch.float64)
    if kind == "precomputed":
        return x.clamp(max=0.0)
    if kind not in GATES:
        raise ValueError(f"gate kind must be one of {GATES}, got {kind!r}")
    heads = g.shape[-2]
    a_log = torch.zeros(heads, dtype=torch.float64, device=g.device) if A_log is None else A_log.to(torch.float64)
    a = torch.exp(a_log)[:, None]  # [H, 1], broadcast over K
    if dt_bias is not None:
        x = x + dt_bias.to(torch.float64)
    if kind == "softplus":
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(a * x)
