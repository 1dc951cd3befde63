"""The build's ABI cross-check against real compiler output (needs nvidia-cutlass-dsl, no GPU)."""

import dataclasses
from pathlib import Path

import pytest

from cula_aot.build.cubin import check_cubin_abi, kernel_params
from cula_aot.build.ptx import AbiMismatch, check_abi, parse_entry
from cula_aot.specs import ARCH, K1Spec, abi_layout, pointer, scalar

pytest.importorskip("cutlass", reason="the build extra (nvidia-cutlass-dsl) is not installed")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from cula_aot.kernels import compile_spec

    spec = K1Spec(heads=1, varlen=True)
    ptx_path, cubin_path = compile_spec(spec, ARCH, str(tmp_path_factory.mktemp("k1")))
    return spec, Path(ptx_path).read_text(), Path(cubin_path).read_bytes()


def test_declared_abi_matches_ptx_and_cubin(compiled):
    spec, ptx, cubin = compiled
    entry = parse_entry(ptx)
    abi = check_abi(spec, entry)
    assert len(entry["params"]) == len(spec.params) and entry["block"] == (128, 1, 1)
    check_cubin_abi(spec.name, cubin, entry["symbol"], abi, spec.block)
    assert kernel_params(cubin, entry["symbol"])["param_bytes"] == abi[-1]["offset"] + abi[-1]["size"]


def _variant(params):
    @dataclasses.dataclass(frozen=True)
    class Variant(K1Spec):
        pass

    Variant.params = tuple(params)
    return Variant(heads=1, varlen=True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda ps: ps[:-1],  # a parameter missing
        lambda ps: [*ps, scalar("extra", "i32")],  # one too many
        lambda ps: [*ps[:-1], scalar("lower_bound", "i32")],  # f32 declared as i32
        lambda ps: [*ps[:14], scalar("seq_len", "f32"), *ps[15:]],  # i32 declared as f32
        lambda ps: [*ps[:13], scalar("ws_beta", "i32"), *ps[14:]],  # pointer declared as scalar
        lambda ps: [*ps[:14], pointer("seq_len", "i32"), *ps[15:]],  # scalar declared as pointer
    ],
)
def test_disagreeing_abi_is_refused(compiled, mutate):
    spec, ptx, _ = compiled
    with pytest.raises(AbiMismatch):
        check_abi(_variant(mutate(list(spec.params))), parse_entry(ptx))


def test_cubin_check_refuses_shifted_offsets(compiled):
    spec, ptx, cubin = compiled
    entry = parse_entry(ptx)
    abi = abi_layout(spec.params)
    abi[-1] = {**abi[-1], "offset": abi[-1]["offset"] + 4}
    with pytest.raises(AbiMismatch):
        check_cubin_abi(spec.name, cubin, entry["symbol"], abi, spec.block)
    with pytest.raises(AbiMismatch):
        check_cubin_abi(spec.name, cubin, entry["symbol"], abi_layout(spec.params), (256, 1, 1))


def test_bulk_copies_are_issued_by_one_thread(compiled):
    # CuTeDSL 4.8.1 does not elect a lane for CopyBulkS2GOp; K1 guards the three image copies
    # with tid == 0 itself, so no elect.sync may appear around them.
    _, ptx, _ = compiled
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 3
    assert "elect.sync" not in ptx
