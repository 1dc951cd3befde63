"""The build's ABI cross-check against real compiler output (needs nvidia-cutlass-dsl, no GPU)."""

import dataclasses
from pathlib import Path

import pytest

from cula_aot.compiler.cubin import check_cubin_abi, kernel_params, place_params
from cula_aot.compiler.ptx import AbiMismatch, check_abi, parse_entry
from cula_aot.specs import ARCH, K1Spec, abi_layout, pointer, scalar

pytest.importorskip("cutlass", reason="the build extra (nvidia-cutlass-dsl) is not installed")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from cula_aot.kernels import compile_spec

    spec = K1Spec(varlen=True)
    ptx_path, cubin_path = compile_spec(spec, ARCH, str(tmp_path_factory.mktemp("k1")))
    return spec, Path(ptx_path).read_text(), Path(cubin_path).read_bytes()


def test_declared_abi_matches_ptx_and_cubin(compiled):
    spec, ptx, cubin = compiled
    entry = parse_entry(ptx)
    abi = check_abi(spec, entry)
    assert len(entry["params"]) == len(spec.params) and entry["block"] == (128, 1, 1)
    placed, param_bytes = place_params(spec.name, cubin, entry["symbol"], abi, spec.block)
    check_cubin_abi(spec.name, cubin, entry["symbol"], placed, param_bytes, spec.block)
    # ptxas aligns the 64-byte descriptors in absolute constant-bank addresses: the first one
    # sits at offset 48, so a naive running-sum layout would be wrong by 48 bytes.
    assert [p["offset"] for p in placed[:3]] == [48, 176, 304]
    assert param_bytes == kernel_params(cubin, entry["symbol"])["param_bytes"] == placed[-1]["offset"] + 4
    assert entry["tma_ranks"] == ["3"] * 9  # one 3-D box per q, k, g tile, three copy sites


def _variant(params):
    @dataclasses.dataclass(frozen=True)
    class Variant(K1Spec):
        pass

    Variant.params = tuple(params)
    return Variant(varlen=True)


def _replaced(params, new):
    """``params`` with the parameter of ``new``'s name replaced by ``new``."""
    return [new if p.name == new.name else p for p in params]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda ps: ps[:-1],  # a parameter missing
        lambda ps: [*ps, scalar("extra", "i32")],  # one too many
        lambda ps: _replaced(ps, scalar("lower_bound", "i32")),  # f32 declared as i32
        lambda ps: _replaced(ps, scalar("seq_len", "f32")),  # i32 declared as f32
        lambda ps: _replaced(ps, scalar("workspace", "i32")),  # pointer declared as scalar
        lambda ps: _replaced(ps, pointer("seq_len", "i32")),  # scalar declared as pointer
        lambda ps: [pointer("tma_q", "bf16"), *ps[1:]],  # descriptor declared as pointer
        lambda ps: [*ps[:3], ps[0], *ps[4:]],  # pointer declared as descriptor
    ],
)
def test_disagreeing_abi_is_refused(compiled, mutate):
    spec, ptx, _ = compiled
    with pytest.raises(AbiMismatch):
        check_abi(_variant(mutate(list(spec.params))), parse_entry(ptx))


def test_cubin_check_refuses_disagreeing_offsets_sizes_and_block(compiled):
    spec, ptx, cubin = compiled
    entry = parse_entry(ptx)
    placed, param_bytes = place_params(spec.name, cubin, entry["symbol"], check_abi(spec, entry), spec.block)
    with pytest.raises(AbiMismatch):  # the naive layout
        check_cubin_abi(spec.name, cubin, entry["symbol"], abi_layout(spec.params), param_bytes, spec.block)
    shifted = [*placed[:-1], {**placed[-1], "offset": placed[-1]["offset"] + 4}]
    with pytest.raises(AbiMismatch):
        check_cubin_abi(spec.name, cubin, entry["symbol"], shifted, param_bytes, spec.block)
    resized = [*placed[:-1], {**placed[-1], "size": 8}]
    with pytest.raises(AbiMismatch):
        place_params(spec.name, cubin, entry["symbol"], resized, spec.block)
    with pytest.raises(AbiMismatch):
        place_params(spec.name, cubin, entry["symbol"], placed, (256, 1, 1))


def test_k1_stores_its_images_from_registers(compiled):
    # K1 loads q, k, g with TMA copies (one elected lane each; three for each of the two first
    # tiles and three for the refill of a buffer) and writes each lane's two rows of the qd, kd,
    # kr images and its 8 gt values as 16-byte stores: no bulk S2G copy.
    _, ptx, _ = compiled
    assert ptx.count("cp.async.bulk.global.shared::cta") == 0
    assert ptx.count("cp.async.bulk.tensor.3d") == 9
    assert ptx.count("elect.sync") == 9
    assert ptx.count("st.global.v4") == 8


def test_dependent_launch_declaration_matches_the_ptx(compiled):
    # K1 never waits for the kernel before it: declaring it a programmatic dependent would let
    # the runtime race whatever ran before it.
    spec, ptx, _ = compiled
    entry = parse_entry(ptx)
    assert not entry["grid_wait"]

    @dataclasses.dataclass(frozen=True)
    class Dependent(K1Spec):
        dependent_launch = True

    with pytest.raises(AbiMismatch, match="griddepcontrol.wait"):
        check_abi(Dependent(varlen=True), entry)
    with pytest.raises(AbiMismatch, match="dependent_launch=False"):
        check_abi(spec, {**entry, "grid_wait": True})


def test_cluster_declaration_matches_the_ptx(compiled):
    # K1 uses no cluster instructions: a declared cluster, or cluster instructions in a kernel
    # declared without one (a multicast into CTAs that are not there), is refused.
    spec, ptx, _ = compiled
    entry = parse_entry(ptx)
    assert entry["cluster"] is None and not entry["cluster_ops"]

    @dataclasses.dataclass(frozen=True)
    class Clustered(K1Spec):
        cluster = (2, 1, 1)

    with pytest.raises(AbiMismatch, match="has no cluster instructions"):
        check_abi(Clustered(varlen=True), entry)
    with pytest.raises(AbiMismatch, match="has cluster instructions"):
        check_abi(spec, {**entry, "cluster_ops": True})
    with pytest.raises(AbiMismatch, match="PTX"):
        check_abi(Clustered(varlen=True), {**entry, "cluster_ops": True, "cluster": (4, 1, 1)})
    assert parse_entry(ptx + "\n\tbarrier.cluster.arrive;\n")["cluster_ops"]
