"""Decode's cached plans (``ops.decode._DecodePlan``) on the CPU: a fake loader over the real
manifest records captures the packed parameters, so the per-call values, the per-call re-checks
and the cache are checked without a GPU."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from cula_aot.ops import checks, decode, plan_cache
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
    monkeypatch.setattr(plan_cache, "raw_stream", lambda device: 0)
    monkeypatch.setattr(decode, "_PLANS", plan_cache.LaunchPlans(decode._DecodePlan))
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
            "num_accepted",
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


def _carve(storage, at, shape, dtype):
    """A contiguous ``dtype`` tensor of ``shape`` starting ``at`` bytes into ``storage`` (a uint8 buffer)."""
    size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return storage[at : at + size].view(dtype).view(shape)


def test_a_cached_plan_checks_each_calls_out_against_every_input(launches):
    """The aliasing rule at every call of a cached signature: out (dense) intersecting the pool
    at its first or last byte is refused, out ending where the pool starts or starting where it
    ends is not; out over the projection q, k, v and g are cut from is refused.  Every call here has the
    layouts of the first, so only the cached plan sees them."""
    pool_bytes, out_bytes = (N + 2) * H * D * D * 4, N * T * H * D * 2
    args = _args(seed=5, out=torch.empty(N, T, H, D, dtype=torch.bfloat16))
    _call(args)
    storage = torch.zeros(out_bytes + pool_bytes + out_bytes + 64, dtype=torch.uint8)
    base = (-storage.data_ptr()) % 16 + out_bytes + 16  # pool 16-byte aligned, with room before it
    pool = _carve(storage, base, (N + 2, H, D, D), torch.float32)
    cases = [
        (base - out_bytes, None),  # ends where the pool starts
        (base + pool_bytes, None),  # starts where the pool ends
        (base - out_bytes + 16, "state_pool"),  # its last 16 bytes are the pool's first
        (base + pool_bytes - 16, "state_pool"),  # starts on the pool's last 16 bytes
        (base + 4096, "state_pool"),  # inside
    ]
    for at, alias in cases:
        call = {**args, "state_pool": pool, "out": _carve(storage, at, (N, T, H, D), torch.bfloat16)}
        if alias is None:
            _call(call)
        else:
            with pytest.raises(KDAInputError, match=f"out must not alias {alias}"):
                _call(call)
    # k, v and g start inside q's extent (one fused projection): the rule names q for each.
    for name in ("q", "k", "v", "g"):
        over = torch.as_strided(args[name], (N, T, H, D), args["out"].stride())
        with pytest.raises(KDAInputError, match="out must not alias q"):
            _call({**args, "out": over})
    assert len(decode._PLANS) == 1 and len(launches) == 3


def test_a_strided_out_aliases_a_strided_input_only_on_its_first_element(launches):
    """Two interleaved views (neither dense) alias only where they start together, on the cached
    path as in validation: out as the q columns of another fused projection passes; the same
    layout over g's columns is refused."""
    other = _args(seed=6)
    args = _args(seed=7, out=other["q"])
    _call(args)
    with pytest.raises(KDAInputError, match="out must not alias g"):
        _call({**args, "out": torch.as_strided(args["g"], args["out"].shape, args["out"].stride())})
    assert len(decode._PLANS) == 1 and len(launches) == 1


def test_a_signature_seen_before_the_last_one_is_still_checked(launches, monkeypatch):
    """Two signatures alternating (the last one found is compared first): each call is checked
    against its own plan's rules, and each plan is validated once."""
    validations = []
    real = decode.validate
    monkeypatch.setattr(decode, "validate", lambda call: validations.append(1) or real(call))
    small = _args(seed=8, out=torch.empty(N, T, H, D, dtype=torch.bfloat16))
    large = {**small, "state_pool": torch.zeros(N + 5, H, D, D)}
    for a in (small, large, small, large):
        _call(a)
    assert len(validations) == 2 and len(decode._PLANS) == 2
    for a in (small, large):
        pool = a["state_pool"]
        inside = torch.as_strided(pool.view(torch.bfloat16), (N, T, H, D), a["out"].stride(), D * D * H * 2)
        with pytest.raises(KDAInputError, match="out must not alias state_pool"):
            _call({**a, "out": inside})
    assert len(launches) == 4 and len(validations) == 2


def test_per_token_slots_take_the_token_kernel_and_their_flags(launches):
    """[N, T] state_indices (vLLM's speculative slots) set the token-slot flag, and num_accepted
    its own flag and pointer, per call; on a bf16 "vk" pool at T = 2, where plain decode runs the
    chunk kernel, they run the token kernel, the one that writes per-token states."""
    from cula_aot.specs import DECODE_FLAG_ACCEPTED, DECODE_FLAG_INTERMEDIATE, DECODE_FLAG_TOKEN_SLOTS

    pool = torch.zeros(2 * N * T, H, D, D, dtype=torch.bfloat16)
    slots = torch.arange(N * T, dtype=torch.int32).view(N, T)
    _call(_args(seed=5, state_pool=pool, state_indices=slots[:, 0].contiguous()))
    accepted = [torch.full((N,), T, dtype=torch.int32), torch.ones(N, dtype=torch.int32)]
    for counts in (None, *accepted):
        _call(_args(seed=6, state_pool=pool, state_indices=slots, num_accepted=counts))
    (plain, _), (none, _), (first, _), (second, _) = launches
    assert not plain["flags"] & DECODE_FLAG_TOKEN_SLOTS
    for values in (none, first, second):
        assert values["flags"] & DECODE_FLAG_TOKEN_SLOTS and not values["flags"] & DECODE_FLAG_INTERMEDIATE
        assert values["intermediate"] == 0
    assert none["num_accepted"] == 0 and not none["flags"] & DECODE_FLAG_ACCEPTED
    for values, counts in zip((first, second), accepted):
        assert values["flags"] & DECODE_FLAG_ACCEPTED and values["num_accepted"] == counts.data_ptr()
    assert len(decode._PLANS) == 3  # [N]; [N, T] without counts; [N, T] with counts (two calls, one plan)
    names = [plan.template.kernel.name for plan in decode._PLANS._plans.values()]
    assert "chunk" in names[0] and not any("chunk" in name for name in names[1:])


def test_an_offset_slot_table_is_passed_as_a_16_byte_base_and_an_element_offset(launches):
    """[N, T] indices and counts at any int32 boundary, as a view into a larger table: the
    kernel takes the table's 16-byte base and its offset in elements, the counts' address as is."""
    buffer = torch.arange(3 + N * T + 5, dtype=torch.int32)
    slots, counts = buffer[3 : 3 + N * T].view(N, T), buffer[1 : 1 + N]
    _call(_args(seed=7, state_pool=torch.zeros(N * T + 3, H, D, D), state_indices=slots, num_accepted=counts))
    ((values, _),) = launches
    assert values["state_indices"] % 16 == 0 and values["index_offset"] == 3
    assert values["state_indices"] + 4 * values["index_offset"] == slots.data_ptr()
    assert values["num_accepted"] == counts.data_ptr()


def test_the_plan_supplies_the_per_call_parameters_in_the_specs_order():
    from cula_aot.specs import DECODE_PARAMS

    assert decode._PER_CALL == tuple(p.name for p in DECODE_PARAMS if p.per_call)


def test_a_repeated_decode_call_launches_its_checked_parameters(launches):
    """``kda_decode`` keeps what a call's check gave by its arguments: the repeat launches the same
    parameters; a changed address or option is checked again before any launch; a call whose
    binding makes tensors (g converted to bf16) launches without being kept."""
    out = torch.empty(N, T, H, D, dtype=torch.bfloat16)
    args = _args(seed=5, out=out)
    _call(args)
    _call(args)
    assert len(launches) == 2 and launches[0] == launches[1]
    assert len(decode._PLANS.launches) == 1
    alias = torch.as_strided(args["v"], (N, T, H, D), out.stride())
    with pytest.raises(KDAInputError, match="out must not alias"):
        _call({**args, "out": alias})
    with pytest.raises(KDAInputError, match=r"beta_sigmoid must be True or False, got 1"):
        _call({**args, "beta_sigmoid": 1})
    with pytest.raises(KDAInputError, match=r"lower_bound must be in \[-5, 0\)"):
        _call({**args, "lower_bound": 0.5})
    assert len(launches) == 2
    _call({**args, "g": args["g"].float()})
    assert len(launches) == 3 and len(decode._PLANS.launches) == 1
    _call({**args, "out": None})  # out allocated: the kept values with its address
    assert len(launches) == 4 and launches[3][0]["out"] != launches[0][0]["out"]
    assert {**launches[3][0], "out": 0} == {**launches[0][0], "out": 0}
