"""Every input rule of CONTRACT §6 raises a clear KDAInputError before any launch (CPU only)."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from tests.helpers import cu_seqlens_of, standard_inputs


def _call(inputs, **overrides):
    args = {**inputs, **overrides}
    return cula_aot.kda_prefill(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **args)


def _checkpoints(**overrides):
    """Valid checkpoint tensors for the one-sequence, two-head inputs, with ``overrides``."""
    return {
        "checkpoint_pool": torch.zeros(3, 2, 128, 128),
        "checkpoint_indices": torch.zeros(1, 2, dtype=torch.int32),
        **overrides,
    }


@pytest.fixture
def inputs():
    return standard_inputs(1, 40, 2, seed=0)


def test_valid_cpu_input_is_refused_only_for_its_device(inputs):
    with pytest.raises(KDAInputError, match="inputs are on cpu: .*CUDA.*\\.cuda\\(\\)"):
        _call(inputs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (lambda x: {"q": x["q"].float()}, "q must be torch.bfloat16, got torch.float32"),
        (lambda x: {"k": x["k"][:, :, :1]}, r"k must have shape \[1, 40, 2, 128\]"),
        (lambda x: {"v": x["v"].transpose(1, 2).contiguous().transpose(1, 2)}, "v must have its last 2 dims packed"),
        (
            lambda x: {"q": torch.zeros(40 * 256 + 8, dtype=torch.bfloat16)[1 : 1 + 40 * 256].view(1, 40, 2, 128)},
            "q must start on a 16-byte boundary",
        ),
        (
            lambda x: {"k": torch.zeros(1, 40, 260, dtype=torch.bfloat16)[..., :256].unflatten(-1, (2, 128))},
            "k must have 16-byte aligned rows",
        ),
        (
            lambda x: {
                "g": torch.zeros(40 * 256, dtype=torch.bfloat16).as_strided((1, 40, 2, 128), (40 * 256, 128, 128, 1))
            },
            "g's token stride 128 is smaller than a token's 256 elements",
        ),
        (lambda x: {"q": torch.zeros(2, 40, 2, 128, dtype=torch.bfloat16)}, r"k must have shape \[2, 40, 2, 128\]"),
        (
            lambda x: {"beta": torch.zeros(1, 40, 3, dtype=torch.bfloat16)[..., 1:]},
            "beta must start on a 16-byte boundary",
        ),
        (
            lambda x: {"beta": x["beta"].transpose(1, 2).contiguous().transpose(1, 2)},
            "beta must have its last 1 dims packed",
        ),
        (lambda x: {"g": x["g"].half()}, "g must be torch.bfloat16"),
        (lambda x: {"beta": x["beta"][..., None]}, r"beta must have shape \[1, 40, 2\]"),
        (lambda x: {"A_log": x["A_log"].double()}, "A_log must be torch.float32"),
        (lambda x: {"dt_bias": x["dt_bias"][:, :64].contiguous()}, r"dt_bias must have shape \[2, 128\]"),
        (lambda x: {"q": x["q"][..., :64].contiguous()}, "head dim must be 128"),
        (lambda x: {"q": x["q"][0]}, r"q must be \[B, T, H, 128\]"),
        (lambda x: {"q": "not a tensor"}, "q must be a torch.Tensor"),
        (lambda x: {"lower_bound": 0.0}, r"lower_bound must be in \[-5, 0\), got 0.0"),
        (lambda x: {"lower_bound": -5.5}, r"lower_bound must be in \[-5, 0\)"),
        (lambda x: {"scale": float("nan")}, "scale must be a finite number"),
        (lambda x: {"gate": "sigmoid"}, "gate must be one of 'safe', 'softplus', 'precomputed', got 'sigmoid'"),
        (lambda x: {"lower_bound": None}, "gate='safe' needs lower_bound .*gate='softplus'"),
        (lambda x: {"gate": "softplus"}, "lower_bound applies to gate='safe' only.*lower_bound=None"),
        (lambda x: {"gate": "precomputed", "lower_bound": None}, "gate='precomputed' takes g as the log-decay itself"),
        (lambda x: {"state_layout": "kvk"}, "state_layout must be one of"),
        (lambda x: {"initial_state": torch.zeros(1, 2, 128, 128)[..., :64]}, "initial_state must have shape"),
        (
            lambda x: {"initial_state": torch.zeros(1, 2, 128, 128, dtype=torch.float16)},
            "initial_state must be torch.float32 or torch.bfloat16",
        ),
        (
            lambda x: {"initial_state": torch.zeros(1, 2, 128, 128).transpose(-1, -2)},
            "initial_state must be contiguous within a slot",
        ),
        (
            lambda x: {
                "initial_state": torch.zeros(1, 2, 128, 128),
                "state_indices": torch.zeros(2, dtype=torch.int32),
            },
            r"state_indices must have shape \[1\]",
        ),
        (
            lambda x: {
                "initial_state": torch.zeros(1, 2, 128, 128),
                "state_indices": torch.zeros(1, dtype=torch.int64),
            },
            "state_indices must be torch.int32",
        ),
        (lambda x: {"state_indices": torch.zeros(1, dtype=torch.int32)}, "pass the pool as initial_state"),
        (
            lambda x: {
                "initial_state": torch.zeros(3, 3, 128, 128),
                "state_indices": torch.zeros(1, dtype=torch.int32),
            },
            r"initial_state must have shape \[slots >= 1, 2, 128, 128\] \(a pool\)",
        ),
        (lambda x: {"check_seqlens": "never"}, "check_seqlens must be one of"),
        (
            lambda x: {"final_state": torch.zeros(2, 2, 128, 128)},
            r"final_state must have shape \[1, 2, 128, 128\] \(one state per sequence\)",
        ),
        (lambda x: {"out": torch.empty(1, 40, 2, 128)}, "out must be torch.bfloat16"),
        (lambda x: {"out": x["q"]}, "out must not alias an input"),
        (lambda x: {"cu_seqlens": torch.tensor([0, 40.0])}, "cu_seqlens must be an int32 or int64 tensor"),
        (lambda x: {"cu_seqlens": torch.tensor([[0, 40]], dtype=torch.int32)}, "cu_seqlens must be 1-D"),
        (lambda x: {"cu_seqlens": torch.tensor([1, 40], dtype=torch.int32)}, "cu_seqlens must start at 0, got 1"),
        (lambda x: {"cu_seqlens": torch.tensor([0, 30, 20, 40], dtype=torch.int32)}, "non-decreasing"),
        (lambda x: {"cu_seqlens": torch.tensor([0, 39], dtype=torch.int64)}, r"must end at T = 40"),
        (lambda x: {"cu_seqlens": torch.tensor([0, 20, 20, 40], dtype=torch.int32)}, "empty sequence 1"),
        (
            lambda x: {"cu_seqlens": torch.tensor([0, 10, 40]), "cu_seqlens_cpu": torch.tensor([0, 40])},
            "cu_seqlens_cpu has 2 entries",
        ),
        (lambda x: {"cu_seqlens_cpu": torch.tensor([0, 40])}, "cu_seqlens_cpu was given without cu_seqlens"),
        (
            lambda x: {"intracard_cp": "yes"},
            "intracard_cp must be 'auto', 'truncated', True, False or an int s_split >= 1",
        ),
        (lambda x: {"intracard_cp": 0}, "intracard_cp must be"),
        (lambda x: {"intracard_cp": 2.0}, "intracard_cp must be"),
        (lambda x: {"status": torch.zeros(1, dtype=torch.int64)}, "status must be a one-element torch.int32 tensor"),
        (lambda x: {"status": torch.zeros(2, dtype=torch.int32)}, "status must be a one-element torch.int32 tensor"),
        (lambda x: {"status": 0}, "status must be a torch.Tensor, got int"),
        (lambda x: {"status": torch.zeros(8, dtype=torch.int32)[1:2]}, "status must start on a 16-byte boundary"),
        (
            lambda x: {"checkpoint_every": 24, **_checkpoints()},
            "checkpoint_every must be a positive int multiple of 16",
        ),
        (lambda x: {"checkpoint_every": 16.0, **_checkpoints()}, "checkpoint_every must be a positive int"),
        (lambda x: {"checkpoint_every": -16, **_checkpoints()}, "checkpoint_every must be a positive int"),
        (lambda x: _checkpoints(), "need checkpoint_every"),
        (lambda x: {"checkpoint_every": 16}, "checkpoint_every needs checkpoint_pool"),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_indices=None)},
            "checkpoint_every needs checkpoint_pool",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_pool=torch.zeros(2, 3, 128, 128))},
            r"checkpoint_pool must have shape \[slots >= 1, 2, 128, 128\] \(a pool\)",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_pool=torch.zeros(2, 2, 128, 128).half())},
            "checkpoint_pool must be torch.float32 or torch.bfloat16",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_indices=torch.zeros(3, dtype=torch.int32))},
            r"checkpoint_indices must be \[N, M\] = \[1, M >= 1\]",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_indices=torch.zeros(2, 3, dtype=torch.int32))},
            r"checkpoint_indices must be \[N, M\] = \[1, M >= 1\]",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_indices=torch.zeros(1, 3))},
            "checkpoint_indices must be torch.int32",
        ),
        (
            lambda x: {
                "checkpoint_every": 16,
                **_checkpoints(checkpoint_indices=torch.zeros(3, 2, dtype=torch.int32).t()[:1]),
            },
            "checkpoint_indices must be contiguous",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_offsets=torch.zeros(2, dtype=torch.int32))},
            r"checkpoint_offsets must have shape \[1\]",
        ),
        (
            lambda x: {"checkpoint_every": 16, **_checkpoints(checkpoint_offsets=torch.zeros(1, dtype=torch.int64))},
            "checkpoint_offsets must be torch.int32",
        ),
    ],
)
def test_rule(inputs, overrides, message):
    with pytest.raises(KDAInputError, match=message):
        _call(inputs, **overrides(inputs))


def test_valid_checkpoints_are_refused_only_for_the_device(inputs):
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        _call(
            inputs,
            checkpoint_every=32,
            **_checkpoints(
                checkpoint_pool=torch.zeros(3, 2, 128, 128, dtype=torch.bfloat16),
                checkpoint_offsets=torch.zeros(1, dtype=torch.int32),
            ),
        )
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        _call(inputs, checkpoint_every=0)


def test_varlen_needs_batch_one():
    inputs = standard_inputs(2, 20, 1, seed=1)
    with pytest.raises(KDAInputError, match="varlen input .* needs batch size 1, got B = 2"):
        _call(inputs, cu_seqlens=cu_seqlens_of([20]))


def test_rejection_writes_nothing(inputs):
    out = torch.full((1, 40, 2, 128), 7.0, dtype=torch.bfloat16)
    final = torch.full((1, 2, 128, 128), 3.0)
    with pytest.raises(KDAInputError):
        _call(inputs, out=out, final_state=final, lower_bound=1.0)
    assert bool((out == 7.0).all()) and bool((final == 3.0).all())


def test_fwd_needs_out(inputs):
    with pytest.raises(KDAInputError, match="out must be a bf16 tensor"):
        cula_aot.fwd(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            inputs["g"],
            inputs["beta"],
            None,
            None,
            inputs["A_log"],
            inputs["dt_bias"],
            inputs["lower_bound"],
        )


@pytest.mark.parametrize("gate", ["softplus", "precomputed"])
def test_unbounded_gates_take_fla_defaults_and_reach_the_device_check(inputs, gate):
    """A_log / dt_bias None are fla's defaults (unit scale, zero bias); the call then fails only for
    its CPU tensors."""
    extra = {"A_log": None, "dt_bias": None} if gate == "precomputed" else {"A_log": None}
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        _call(inputs, gate=gate, lower_bound=None, **extra)


def test_more_sequences_than_the_grid_holds_is_refused():
    inputs = standard_inputs(1, 65536, 1, seed=2)
    cu = torch.arange(65537, dtype=torch.int64)
    with pytest.raises(KDAInputError, match="cu_seqlens has 65536 sequences; one call runs at most 65535"):
        _call(inputs, cu_seqlens=cu, cu_seqlens_cpu=cu)
    fixed = {name: t.view(65536, 1, *t.shape[2:]) for name, t in inputs.items() if name in ("q", "k", "v", "g", "beta")}
    with pytest.raises(KDAInputError, match="q has 65536 sequences"):
        _call({**inputs, **fixed})
