"""Decode's cached plans (``ops.decode._DecodePlan``) on the CPU: a fake loader over the real
manifest records captures the packed parameters, so the per-call values, the per-call re-checks
and the cache are checked without a GPU."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from cula_aot.ops import checks, decode
from cula_aot.runtime.loader import LoadedKernel
from cula_aot.runtime.manifest import Manifest
from tests.decode_helpers import fused_inputs

N, T, H, D = 3, 2, 4, 128


@pytest.fixture
def launches(monkeypatch):
    manifest, recorded = Manifest.discover(), []

    class FakeLoader:
        def get(self, device, spec):
            name, record = manifest.record(spec)
            kernel = LoadedKernel(name, record, function=None)

            def launch_packed(packed, grid, stream, smem_bytes=None, dependent=False):
                recorded.append((dict(zip(kernel.packer.names, kernel.packer.struct.unpack(packed))), smem_bytes))

            kernel.launch_packed = launch_packed
            return kernel

    loader = FakeLoader()
    monkeypatch.setattr(decode, "default_loader", lambda: loader)
    monkeypatch.setattr(checks, "check_device", lambda device: None)
    monkeypatch.setattr(decode, "_current_stream", lambda device: 0)
    monkeypatch.setattr(decode, "_PLANS", {})
    return recorded


def _args(seed=0, **overrides):
    x = fused_inputs(N, T, H, device="cpu", seed=seed)
    x["state_pool"] = torch.zeros(N + 2, H, D, D)
    x["state_indices"] = torch.tensor([0, 3, -1], dtype=torch.int32)
    return {**x, **overrides}


def _call(args):
    a = dict(args)
    return cula_aot.kda_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


def test_a_repeated_signature_validates_once_and_takes_each_calls_addresses(launches, monkeypatch):
    validations = []
    real = decode.validate
    monkeypatch.setattr(decode, "validate", lambda call: validations.append(1) or real(call))
    first, second = _args(seed=1), _args(seed=2, lower_bound=-3.0, scale=0.25)
    out1, out2 = _call(first), _call(second)
    assert len(validations) == 1 and len(decode._PLANS) == 1 and len(launches) == 2
    for (values, smem), x, out in zip(launches, (first, second), (out1, out2)):
        assert values["q"] == x["q"].data_ptr() and values["state_pool"] == x["state_pool"].data_ptr()
        assert values["out"] == out.data_ptr()
        # β sits one element past a 16-byte boundary (fused_inputs): base and offset per call.
        assert values["beta"] + 2 * values["beta_offset"] == x["beta"].data_ptr() and values["beta"] % 16 == 0
        assert values["state_indices"] + 4 * values["index_offset"] == x["state_indices"].data_ptr()
        assert smem is not None
    assert launches[1][0]["lower_bound"] == -3.0 and launches[1][0]["scale"] == 0.25
    # The static values are the signature's: strides, counts, flags.
    static = [
        n
        for n in launches[0][0]
        if n
        not in (
            "q",
            "k",
            "v",
            "g",
            "beta",
            "a_log",
            "dt_bias",
            "state_indices",
            "state_pool",
            "intermediate",
            "out",
            "status",
            "beta_offset",
            "index_offset",
            "scale",
            "lower_bound",
        )
    ]
    assert static and all(launches[0][0][n] == launches[1][0][n] for n in static)
    # A new signature (other strides) makes a new plan.
    _call(_args(seed=3, state_pool=torch.zeros(N + 5, H, D, D)))
    assert len(validations) == 2 and len(decode._PLANS) == 2


def test_the_cached_path_still_checks_what_the_addresses_decide(launches):
    args = _args(seed=4, out=torch.empty(N, T, H, D, dtype=torch.bfloat16))
    _call(args)
    # out over v's storage, the same layout as before: the signature is the cached one's.
    fused_v = args["v"]
    alias = torch.as_strided(fused_v, (N, T, H, D), args["out"].stride())
    assert alias.stride() == args["out"].stride() and alias.data_ptr() == fused_v.data_ptr()
    with pytest.raises(KDAInputError, match="out must not alias"):
        _call({**args, "out": alias})
    with pytest.raises(KDAInputError, match=r"lower_bound must be in \[-5, 0\)"):
        _call({**args, "lower_bound": 0.5})
    pool = torch.zeros(N + 2 + N * T + 1, H, D, D)
    inter_args = {**args, "state_pool": pool[: N + 2], "intermediate_states": torch.zeros(N, T, H, D, D)}
    _call(inter_args)
    with pytest.raises(KDAInputError, match="intermediate_states must not overlap state_pool"):
        _call({**inter_args, "intermediate_states": pool[1 : 1 + N * T].view(N, T, H, D, D)})
    storage = torch.zeros(N * T * H * D * 2 + 8, dtype=torch.bfloat16)
    shifted = storage[1 : 1 + N * T * H * D].view(N, T, H, D)
    with pytest.raises(KDAInputError, match="out must start on a 16-byte"):
        _call({**args, "out": shifted})
    assert len(launches) == 2  # nothing refused was launched
