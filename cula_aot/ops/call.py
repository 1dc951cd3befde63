"""A call as one typed object, built once at the boundary: ``PrefillCall`` and ``DecodeCall``.

Every entry point (``kda_prefill``, ``fwd``, ``kda_decode``, the ``torch.library`` ops, and through
them ``cula_aot.fla`` and ``cula_aot.distributed``) maps its arguments onto ``build``, which
resolves what does not depend on validation: the gate's arguments (``gates.resolve_gate``), g and
β in the kernels' dtype, the input-convention bits, a pool's in-place final state.  Validation
takes the call and returns the checked facts; the plan cache keys on ``PrefillCall.signature``;
plans run from the call.  Immutable (a tuple): nothing downstream rewrites an argument.
"""

from typing import NamedTuple

import torch

from ..gates import DEFAULT_GATE, GateArgs, resolve_gate
from .checks import input_flags, kernel_dtypes


class CheckpointSink(NamedTuple):
    """Where a prefill writes its prefix-cache checkpoints (``kda_prefill``'s ``checkpoint_*``):
    the period in tokens (0: none), the pool, the slot map ``[N, M]`` and the optional per-sequence
    token offsets."""

    every: object = 0
    pool: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


NO_CHECKPOINT_SINK = CheckpointSink()


def _layout(t) -> tuple | None:
    """What a cached plan fixes of a tensor argument: shape, strides, dtype and device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class PrefillCall(NamedTuple):
    """One prefill call's arguments as the path choice, validation and plans read them (see
    ``cula_aot.kda_prefill`` for each).  ``v_block`` / ``fused``: path overrides for tests and
    benchmarks (``paths.choose_path``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gate: GateArgs
    scale: object
    conventions: int
    initial_state: torch.Tensor | None
    final_state: torch.Tensor | None
    output_final_state: bool
    state_indices: torch.Tensor | None
    state_layout: str
    out: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    check_seqlens: str
    intracard_cp: object
    status: torch.Tensor | None
    checkpoints: CheckpointSink
    v_block: int | None = None
    fused: bool | None = None

    @classmethod
    def build(
        cls,
        q,
        k,
        v,
        g,
        beta,
        *,
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        gate=DEFAULT_GATE,
        scale=None,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=None,
        cu_seqlens_cpu=None,
        state_layout="vk",
        intracard_cp="auto",
        out=None,
        final_state=None,
        state_indices=None,
        check_seqlens="auto",
        status=None,
        beta_sigmoid=True,
        qk_l2norm=True,
        checkpoint_every=0,
        checkpoint_pool=None,
        checkpoint_indices=None,
        checkpoint_offsets=None,
        v_block=None,
        fused=None,
    ) -> "PrefillCall":
        """The call of ``kda_prefill``'s arguments (and the two path overrides)."""
        gate_args = resolve_gate(gate, A_log, dt_bias, lower_bound, q)
        g, beta = kernel_dtypes(g, beta)
        if state_indices is not None and output_final_state and final_state is None:
            final_state = initial_state  # a pool's final states go back where they came from
        sink = CheckpointSink(checkpoint_every, checkpoint_pool, checkpoint_indices, checkpoint_offsets)
        return cls(
            q,
            k,
            v,
            g,
            beta,
            gate_args,
            scale,
            input_flags(beta_sigmoid, qk_l2norm),
            initial_state,
            final_state,
            output_final_state,
            state_indices,
            state_layout,
            out,
            cu_seqlens,
            cu_seqlens_cpu,
            check_seqlens,
            intracard_cp,
            status,
            sink,
            v_block,
            fused,
        )

    def signature(self) -> tuple:
        """The plan cache's key: every tensor's layout and every option a plan fixes (not the
        addresses, scale or lower_bound, which each call supplies).  Raises AttributeError for a
        non-tensor; an unhashable option raises TypeError where it is looked up (validation then
        names either)."""
        c, gate = self.checkpoints, self.gate
        tensors = (
            self.q,
            self.k,
            self.v,
            self.g,
            self.beta,
            gate.A_log,
            gate.dt_bias,
            self.initial_state,
            self.final_state,
            self.out,
            self.cu_seqlens,
            self.cu_seqlens_cpu,
            self.state_indices,
            self.status,
            c.pool,
            c.indices,
            c.offsets,
        )
        key = (
            tuple(map(_layout, tensors)),
            self.state_layout,
            type(self.intracard_cp),
            self.intracard_cp,
            bool(self.output_final_state),
            self.check_seqlens,
            self.v_block,
            self.fused,
            gate.name,
            self.conventions,
            type(c.every),
            c.every,
        )
        return key


class DecodeCall(NamedTuple):
    """One decode call's arguments (see ``cula_aot.kda_decode``).  ``variant``: a built kernel
    variant to run instead of ``specs.pick_variant``'s (tests and benchmarks)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gate: GateArgs
    scale: object
    conventions: int
    state_pool: torch.Tensor
    state_indices: torch.Tensor
    out: torch.Tensor | None
    num_tokens: int | None
    state_layout: str
    intermediate_states: torch.Tensor | None
    status: torch.Tensor | None
    variant: tuple | None = None

    @classmethod
    def build(
        cls,
        q,
        k,
        v,
        g,
        beta,
        *,
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        gate=DEFAULT_GATE,
        scale=None,
        state_pool,
        state_indices,
        out=None,
        num_tokens=None,
        state_layout="vk",
        intermediate_states=None,
        status=None,
        beta_sigmoid=True,
        qk_l2norm=True,
        variant=None,
    ) -> "DecodeCall":
        """The call of ``kda_decode``'s arguments (and the variant override)."""
        gate_args = resolve_gate(gate, A_log, dt_bias, lower_bound, q)
        g, beta = kernel_dtypes(g, beta)
        return cls(
            q,
            k,
            v,
            g,
            beta,
            gate_args,
            scale,
            input_flags(beta_sigmoid, qk_l2norm),
            state_pool,
            state_indices,
            out,
            num_tokens,
            state_layout,
            intermediate_states,
            status,
            variant,
        )
