"""Hostile cu_seqlens and state_indices on every path stay inside the buffers, set the status
word, and leave the process able to run correct calls (``hostile_device_values``)."""

import pytest
import torch

from cula_aot import KDAInputError
from cula_aot.ops.prefill import prefill
from tests.helpers import cu_seqlens_of, standard_inputs
from tests.ops.hostile_device_values import run

pytestmark = pytest.mark.gpu


def test_hostile_device_values_stay_inside_the_buffers():
    calls, failures = run()
    assert calls > 100
    assert not failures, "\n".join(failures[:20])


def test_cp_checks_the_host_lengths_it_plans_from_even_with_checks_off():
    x = standard_inputs(1, 700, 2, device="cuda")
    cu = cu_seqlens_of([400, 300], "cuda")
    out = torch.full_like(x["v"], 7.0)
    with pytest.raises(KDAInputError, match="non-decreasing"):
        prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            cu_seqlens=cu,
            cu_seqlens_cpu=torch.tensor([0, 400, 300]),
            check_seqlens="off",
            intracard_cp=2,
            out=out,
        )
    assert bool((out == 7.0).all())
