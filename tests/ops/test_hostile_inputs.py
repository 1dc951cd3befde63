"""Hostile inputs (property-based): every corruption raises KDAInputError naming the argument,
before any launch, and leaves ``out`` / ``final_state`` untouched.  Runs on the CPU: the device
rule is checked last, so every other rule is reachable with CPU tensors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cula_aot
from cula_aot import KDAInputError
from tests.helpers import cu_seqlens_of, standard_inputs

LENGTHS = [5, 16, 19]
T = sum(LENGTHS)
H = 2


def _base():
    inputs = standard_inputs(1, T, H, seed=0)
    inputs["cu_seqlens"] = cu_seqlens_of(LENGTHS)
    inputs["initial_state"] = torch.zeros(3, H, 128, 128)
    return inputs


def _cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


CORRUPTIONS = {
    # argument: replacement builders, each an invalid value for it
    "q": [
        lambda x: x["q"].float(),
        lambda x: x["q"][..., :64].contiguous(),
        lambda x: x["q"][:, :-1].contiguous(),
        lambda x: x["q"].transpose(1, 2).contiguous().transpose(1, 2),
        lambda x: x["q"][0],
    ],
    # token-strided views that break a rule: rows not 16-byte aligned, overlapping rows
    "v": [
        lambda x: x["v"].to(torch.float64),
        lambda x: x["v"][:, ::2].contiguous(),
        lambda x: torch.zeros(1, T, H * 128 + 4, dtype=torch.bfloat16)[..., : H * 128].unflatten(-1, (H, 128)),
        lambda x: torch.zeros(T * H * 128, dtype=torch.bfloat16).as_strided((1, T, H, 128), (T * 128, 128, 128, 1)),
    ],
    "k": [lambda x: x["k"].half(), lambda x: x["k"][:, :, :1].contiguous(), lambda x: x["k"].expand(2, -1, -1, -1)],
    "g": [lambda x: x["g"].half(), lambda x: x["g"].double(), lambda x: x["g"][..., :127].contiguous()],
    "A_log": [lambda x: x["A_log"].double(), lambda x: x["A_log"][:1].contiguous(), lambda x: x["A_log"].bfloat16()],
    "dt_bias": [lambda x: x["dt_bias"].t().contiguous(), lambda x: x["dt_bias"].half()],
    "lower_bound": [lambda x: 0.0, lambda x: 0.5, lambda x: -5.01, lambda x: float("nan")],
    "cu_seqlens": [
        lambda x: _cu([0, 30, 20, T]),
        lambda x: _cu([0, -4, T]),
        lambda x: _cu([0, 5, T + 7]),
        lambda x: _cu([1, 5, T]),
        lambda x: _cu([0, 5, 5, T]),
        lambda x: _cu([0.0, T * 1.0], torch.float32),
        lambda x: _cu([[0, T]]),
        lambda x: _cu([0]),
        lambda x: _cu([0, T], torch.int16),
    ],
    "initial_state": [
        lambda x: x["initial_state"][:2].contiguous(),
        lambda x: x["initial_state"].double(),
        lambda x: x["initial_state"].transpose(-1, -2),
        lambda x: x["initial_state"].half(),
        lambda x: torch.zeros(3 * H * 128 * 128).as_strided((3, H, 128, 128), (128, 16384, 128, 1)),
    ],
    "state_layout": [lambda x: "KV", lambda x: None],
    "scale": [lambda x: float("inf")],
    "intracard_cp": [lambda x: -1, lambda x: 0, lambda x: "on", lambda x: 1.5],
    "state_indices": [
        lambda x: torch.zeros(2, dtype=torch.int32),
        lambda x: torch.zeros(3, dtype=torch.int64),
        lambda x: torch.zeros(3, 1, dtype=torch.int32),
        lambda x: [0, 1, 2],
    ],
    "check_seqlens": [lambda x: "never", lambda x: True],
    "beta": [
        lambda x: x["beta"].half(),
        lambda x: x["beta"][..., None],
        lambda x: x["beta"][:, 1:].contiguous(),
        lambda x: torch.zeros(1, T, H + 1, dtype=torch.bfloat16)[..., 1:],
    ],
}
CASES = [(arg, i) for arg, builders in CORRUPTIONS.items() for i in range(len(builders))]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES))
def test_corruption_is_refused_before_launch(case):
    arg, index = case
    inputs = _base()
    inputs[arg] = CORRUPTIONS[arg][index](inputs)
    out = torch.full((1, T, H, 128), 7.0, dtype=torch.bfloat16)
    final = torch.full((3, H, 128, 128), 3.0)
    names = {"q", "k", "v", "g", "beta"}
    positional = [inputs.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(KDAInputError) as excinfo:
        cula_aot.kda_prefill(*positional, out=out, final_state=final, **inputs)
    message = str(excinfo.value)
    # q defines B, T, H: a q corruption may surface as another input disagreeing with it.
    named = names | {"head dim"} if arg == "q" else {arg}
    assert any(name in message for name in named), message
    assert "inputs are on cpu" not in message, message  # a real rule fired, not the device one
    assert bool((out == 7.0).all()) and bool((final == 3.0).all())


def test_uncorrupted_input_reaches_only_the_device_rule():
    inputs = _base()
    positional = [inputs.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        cula_aot.kda_prefill(*positional, **inputs)
