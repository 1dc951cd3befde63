"""The loader's CPU-side refusals: each names the artifact and the remedy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cula_aot.runtime.abi import ParamPacker
from cula_aot.runtime.loader import LoadedKernel
from cula_aot.runtime.manifest import ENV_ARTIFACTS, ArtifactError, Manifest, find_manifest
from cula_aot.specs import K1Spec, K2Spec, MergeSpec, abi_layout, segmented_k2_spec


def _record(m):
    return m.record(K1Spec(varlen=False))[1]


def test_tampered_cubin_is_refused(artifact_copy):
    m = Manifest(artifact_copy / "manifest.json")
    path = artifact_copy / _record(m)["cubin"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="modified or truncated.*build_kernels.py"):
        m.read_cubin(_record(m))


def test_truncated_and_missing_cubins_are_refused(artifact_copy):
    m = Manifest(artifact_copy / "manifest.json")
    path = artifact_copy / _record(m)["cubin"]
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ArtifactError, match="truncated"):
        m.read_cubin(_record(m))
    path.unlink()
    with pytest.raises(ArtifactError, match="missing.*build_kernels.py"):
        m.read_cubin(_record(m))


def test_verified_cubin_is_returned(artifact_copy):
    m = Manifest(artifact_copy / "manifest.json")
    assert m.read_cubin(_record(m))[:4] == b"\x7fELF"


def test_foreign_arch_is_refused(manifest_path):
    m = Manifest(manifest_path)
    m.check_arch("sm_90a")
    with pytest.raises(ArtifactError, match="built for sm_90a.*sm_80.*Hopper"):
        m.check_arch("sm_80")


def test_unbuilt_specialization_names_the_build_command(manifest_path):
    m = Manifest(manifest_path)
    with pytest.raises(ArtifactError, match=r"no k2_recurrence specialization.*'v_block': 8.*build_kernels.py"):
        m.record(K2Spec(varlen=False, v_block=8))


def test_schema_mismatch_and_garbage_are_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    data = json.loads(path.read_text())
    data["schema_version"] = 999
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="schema 999.*Rebuild"):
        Manifest(path)
    path.write_text("{not json")
    with pytest.raises(ArtifactError, match="cannot read manifest"):
        Manifest(path)


def _rewrite(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return data


def test_manifest_from_another_package_or_cutedsl_version_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    original = json.loads(path.read_text())
    _rewrite(path, package_version="0.0.9")
    with pytest.raises(ArtifactError, match="built by cula-aot 0.0.9, this is cula-aot .*Rebuild"):
        Manifest(path)
    _rewrite(path, package_version=original["package_version"], cutedsl_version="4.9.0")
    with pytest.raises(ArtifactError, match="compiled with CuTeDSL 4.9.0.*keyed on CuTeDSL 4.8.1"):
        Manifest(path)


def test_manifest_mixing_builds_is_refused(artifact_copy):
    path = artifact_copy / "manifest.json"
    data = json.loads(path.read_text())
    name = next(iter(data["kernels"]))
    data["kernels"][name]["cubin"] = data["kernels"][name]["cubin"].replace("/sm_90a/", "/sm_100a/")
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="names cubins outside artifacts/4.8.1/sm_90a/.*mixes builds"):
        Manifest(path)


def test_pinned_cutedsl_matches_pyproject():
    import tomllib

    from cula_aot.specs import CUTEDSL_VERSION

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("running outside the source checkout (installed wheel)")
    build_extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["build"]
    assert f"nvidia-cutlass-dsl=={CUTEDSL_VERSION}" in build_extra
    assert [d for d in build_extra if d.startswith("nvidia-cutlass-dsl")] == [f"nvidia-cutlass-dsl=={CUTEDSL_VERSION}"]


def test_env_var_takes_priority_and_never_falls_back(artifact_copy, tmp_path_factory, monkeypatch):
    monkeypatch.setenv(ENV_ARTIFACTS, str(artifact_copy))
    assert find_manifest() == artifact_copy / "manifest.json"
    empty = tmp_path_factory.mktemp("empty")
    monkeypatch.setenv(ENV_ARTIFACTS, str(empty))
    with pytest.raises(ArtifactError, match=f"\\${ENV_ARTIFACTS}.*build_kernels.py"):
        find_manifest()


def test_packer_places_values_at_abi_offsets():
    records = abi_layout(K1Spec.params)
    packer = ParamPacker(records, "k1")
    values = {r["name"]: 16 * (i + 1) for i, r in enumerate(records)}
    values.update(scale=0.5, lower_bound=-5.0, tma_q=bytes(128), tma_k=bytes(128), tma_g=bytes(128))
    blob = packer.pack(values)
    assert len(blob) == packer.size == records[-1]["offset"] + 4
    by_name = {r["name"]: r for r in records}
    assert int.from_bytes(blob[by_name["a_log"]["offset"] :][:8], "little") == values["a_log"]
    assert int.from_bytes(blob[by_name["total_slots"]["offset"] :][:4], "little") == values["total_slots"]
    import struct

    assert struct.unpack_from("<f", blob, by_name["lower_bound"]["offset"])[0] == -5.0


def test_packer_places_descriptors_and_pads_to_the_cubin_block():
    records = abi_layout(K1Spec.params)
    records = [{**r, "offset": r["offset"] + 48} for r in records]  # as ptxas places them
    total = records[-1]["offset"] + 4 + 8
    packer = ParamPacker(records, "k1", total)
    values = {r["name"]: 16 for r in records}
    values.update(tma_q=b"\x01" * 128, tma_k=b"\x02" * 128, tma_g=b"\x03" * 128)
    blob = packer.pack(values)
    assert len(blob) == total and blob[:48] == bytes(48)
    assert blob[48:176] == b"\x01" * 128 and blob[176:304] == b"\x02" * 128
    with pytest.raises(ValueError, match="descriptor 'tma_k' must be 128 encoded bytes"):
        packer.pack({**values, "tma_k": b"short"})


def test_tma_recipe_validation_happens_before_the_driver():
    from cula_aot.runtime.tma import DescriptorCache

    recipe = dict(abi_layout(K1Spec.params)[0]["recipe"])
    values = {"rows": 100, "row_blocks": 32, "q_row_bytes": 2048}
    with pytest.raises(ValueError, match="16-byte aligned tensor base"):
        DescriptorCache(recipe, "k1.tma_q").get(0x1008, values)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        DescriptorCache(recipe, "k1.tma_q").get(0x1000, {**values, "q_row_bytes": 2050})
    with pytest.raises(ValueError, match="must be positive"):
        DescriptorCache(recipe, "k1.tma_q").get(0x1000, {**values, "rows": 0})


def test_token_tma_box_lands_where_the_kernels_read_the_tile():
    """The recipe's 3-D box, copied the way TMA does (box dimension 0 fastest in shared memory),
    puts element (row, column) of head h's 16×128 tile at the kernels' ``input_element_offset``,
    with a padded token stride (a view cut from a fused projection)."""
    common = pytest.importorskip("cula_aot.kernels.common")  # the build extra (CuTeDSL)
    from cula_aot.ops.prepare import input_geometry

    heads, rows, token0, head = 3, 40, 21, 2
    stride = heads * 128 + 8  # elements
    recipe = dict(abi_layout(K1Spec.params)[0]["recipe"])
    values = input_geometry(1, rows, heads, {"q": stride, "k": stride, "g": stride, "beta": heads})
    dims = [d if isinstance(d, int) else values[d] for d in recipe["global_dims"]]
    strides = [2] + [s if isinstance(s, int) else values[s] for s in recipe["global_strides_bytes"]]
    assert recipe["rank"] == 3 and dims == [32, rows, heads * 4]
    tensor = torch.arange(rows * stride, dtype=torch.int64)  # element index = its value
    box = recipe["box_dims"]
    origin = (0, token0, 4 * head)  # the PTX coordinates {0, first row, 4·head}
    smem = torch.empty(box[0] * box[1] * box[2], dtype=torch.int64)
    for i2 in range(box[2]):
        for i1 in range(box[1]):
            for i0 in range(box[0]):
                at = sum((o + i) * s for o, i, s in zip(origin, (i0, i1, i2), strides)) // 2
                smem[(i2 * box[1] + i1) * box[0] + i0] = tensor[at]
    for row in range(16):
        for col in range(128):
            assert smem[common.input_element_offset(row, col)] == (token0 + row) * stride + head * 128 + col


def test_descriptor_cache_encodes_once_per_address_and_shape(monkeypatch):
    from cula_aot.runtime import tma

    encoded = []

    def fake_encode(recipe, base, dims, strides, what):
        encoded.append((base, dims, strides))
        return bytes([len(encoded)]) * 128

    monkeypatch.setattr(tma, "_encode", fake_encode)
    cache = tma.DescriptorCache(dict(abi_layout(K1Spec.params)[0]["recipe"]), "k1.tma_q")
    values = {"rows": 100, "row_blocks": 32, "q_row_bytes": 2048}
    first = cache.get(0x1000, values)
    assert cache.get(0x1000, dict(values)) is first and len(encoded) == 1  # the per-call fast path
    assert cache.get(0x1000, {**values, "rows": 101}) != first  # another shape is another descriptor
    assert cache.get(0x2000, values) != first and len(encoded) == 3  # another buffer too
    for address in range(tma.DescriptorCache.ENTRIES + 5):  # bounded: cleared when full
        cache.get(0x10000 + 16 * address, values)
    assert len(cache._encoded) <= tma.DescriptorCache.ENTRIES


def test_packer_refuses_bad_values():
    records = abi_layout(K1Spec.params)
    packer = ParamPacker(records, "k1")
    good = {r["name"]: (bytes(128) if r["kind"] == "tma_descriptor" else 16) for r in records}
    with pytest.raises(ValueError, match="no value for parameters \\['beta'\\]"):
        packer.pack({k: v for k, v in good.items() if k != "beta"})
    with pytest.raises(ValueError, match="pointer 'beta'.*16-byte aligned"):
        packer.pack({**good, "beta": 18})
    with pytest.raises(ValueError, match="'seq_len'.*int32"):
        packer.pack({**good, "seq_len": 2**31})


def test_runtime_never_imports_cutlass():
    # The package, the loader, the prefill and decode entry points and the input generators
    # (cula_aot.testing), down to reading a cubin: no cutlass module anywhere.
    code = (
        "import sys, cula_aot, cula_aot.runtime.loader, cula_aot.runtime.manifest, cula_aot.ops.prepare\n"
        "import cula_aot.ops.decode, cula_aot.testing\n"
        "from cula_aot.runtime.manifest import Manifest\n"
        "Manifest.discover().read_cubin(next(iter(Manifest.discover().kernels.values())))\n"
        "bad = [m for m in sys.modules if m == 'cutlass' or m.startswith('cutlass.')]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_ARTIFACTS}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).resolve().parents[2])


def test_dependent_launch_only_for_kernels_that_wait(manifest_path):
    # Launching a kernel without griddepcontrol.wait as a programmatic dependent would let it
    # read its predecessor's output early: refused before the driver is reached.
    manifest = Manifest(manifest_path)
    for spec, waits in ((K1Spec(varlen=True), False), (MergeSpec(v_block=8), True), (segmented_k2_spec(), True)):
        name, record = manifest.record(spec)
        assert record["dependent_launch"] is waits, name
    name, record = manifest.record(K1Spec(varlen=True))
    kernel = LoadedKernel(name, record, function=None)
    with pytest.raises(ValueError, match="cannot be launched as a programmatic dependent"):
        kernel.launch_packed(bytes(kernel.packer.size), (1, 1, 1), 0, dependent=True)
    with pytest.raises(ValueError, match="cannot be launched as a programmatic dependent"):
        kernel.template({}, dependent=True)


def test_dependent_launch_config_carries_the_pdl_attribute(manifest_path):
    from cuda.bindings import driver as cu

    name, record = Manifest(manifest_path).record(segmented_k2_spec())
    kernel = LoadedKernel(name, record, function=None)
    config = kernel._ex_config((8, 4, 3), 4096, 0, dependent=True)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (8, 4, 3)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == tuple(record["block"])
    assert config.sharedMemBytes == 4096 and config.numAttrs == 1
    attribute = config.attrs[0]
    assert attribute.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1
    assert kernel._ex_config((8, 4, 3), 4096, 0, dependent=True) is config  # built once per shape
    assert kernel._ex_config((8, 4, 2), 4096, 0, dependent=True) is not config


def test_cluster_kernel_launches_with_its_cluster_shape(manifest_path):
    from cuda.bindings import driver as cu

    from cula_aot.specs import serial_k2_spec

    name, record = Manifest(manifest_path).record(serial_k2_spec(True, 64))
    assert record["cluster"] == [2, 1, 1]
    kernel = LoadedKernel(name, record, function=None)
    config = kernel._ex_config((2, 4, 3), 4096, 0, dependent=True)
    ids = [a.id for a in config.attrs]
    assert config.numAttrs == 2 and cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION in ids
    cluster = config.attrs[ids.index(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)].value.clusterDim
    assert (cluster.x, cluster.y, cluster.z) == (2, 1, 1)
    alone = kernel._ex_config((2, 4, 3), 4096, 0, dependent=False)
    assert alone.numAttrs == 1 and alone.attrs[0].id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    with pytest.raises(ValueError, match="clusters"):
        kernel._ex_config((3, 4, 3), 4096, 0, dependent=False)


def test_a_launch_hands_the_driver_its_packed_bytes_and_names_a_failure(manifest_path, monkeypatch):
    """``launch_packed`` fills the thread's parameter buffer in place and passes the driver the
    ``extra`` array pointing at it (CU_LAUNCH_PARAM_BUFFER_POINTER, its size); a launch error
    raises ``CudaError`` naming the kernel."""
    import ctypes

    from cuda.bindings import driver as cu

    from cula_aot.runtime.driver import CudaError

    name, record = Manifest(manifest_path).record(K1Spec(varlen=False))
    kernel = LoadedKernel(name, record, function=None)
    seen, results = [], [(cu.CUresult.CUDA_SUCCESS,)] * 2 + [(cu.CUresult.CUDA_ERROR_INVALID_VALUE,)]

    def launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        words = (ctypes.c_size_t * 5).from_address(extra)
        assert words[0] == cu.CU_LAUNCH_PARAM_BUFFER_POINTER and words[4] == cu.CU_LAUNCH_PARAM_END
        size = ctypes.c_size_t.from_address(words[3]).value
        seen.append(((gx, gy, gz), (bx, by, bz), smem, int(stream), ctypes.string_at(words[1], size)))
        return results[len(seen) - 1]

    monkeypatch.setattr(cu, "cuLaunchKernel", launch)
    monkeypatch.setattr(cu, "cuGetErrorName", lambda err: (0, b"CUDA_ERROR_INVALID_VALUE"))
    monkeypatch.setattr(cu, "cuGetErrorString", lambda err: (0, b"invalid argument"))
    first, second = os.urandom(kernel.packer.size), os.urandom(kernel.packer.size)
    kernel.launch_packed(first, (3, 2, 1), 0x7F00DEADBEE0)
    kernel.launch_packed(second, (5, 2, 1), 0, smem_bytes=1024)
    assert seen[0] == ((3, 2, 1), tuple(record["block"]), kernel.smem, 0x7F00DEADBEE0, first)
    assert seen[1] == ((5, 2, 1), tuple(record["block"]), 1024, 0, second)
    with pytest.raises(CudaError, match=f"cuLaunchKernel\\({name}\\) failed: CUDA_ERROR_INVALID_VALUE"):
        kernel.launch_packed(first, (1, 1, 1), 0)


def _fake_record(params) -> dict:
    records = abi_layout(params)
    return {
        "block": [128, 1, 1],
        "dynamic_smem_bytes": 0,
        "grid": [1, "heads", 1],
        "params": records,
        "param_bytes": records[-1]["offset"] + records[-1]["size"],
    }


def test_per_call_is_read_from_the_record_not_the_dtype():
    from cula_aot.specs import pointer, scalar

    params = (
        pointer("x", "f32"),
        scalar("length", "i32"),  # static: fixed by the template
        scalar("offset", "i32", per_call=True),  # a per-call integer
        scalar("scale", "f32", per_call=True),
        scalar("damping", "f32"),  # a static float
    )
    record = _fake_record(params)
    assert [r["per_call"] for r in record["params"]] == [True, False, True, True, False]
    kernel = LoadedKernel("fake", record, function=None)
    assert kernel.per_call == ("x", "offset", "scale")


def test_a_cached_template_takes_declared_per_call_integers_per_call(monkeypatch):
    """A per-call i32 changes between two launches of one cached template; a static one keeps
    the value the template was built with, whatever a call's values say."""
    import struct

    from cula_aot.specs import pointer, scalar

    params = (
        pointer("x", "f32"),
        scalar("length", "i32"),
        scalar("offset", "i32", per_call=True),
        scalar("scale", "f32", per_call=True),
    )
    kernel = LoadedKernel("fake", _fake_record(params), function=None)
    launched = []
    monkeypatch.setattr(
        kernel, "launch_packed", lambda packed, grid, stream, smem_bytes=None, dependent=False: launched.append(packed)
    )
    template = kernel.template({"heads": 2, "length": 7})
    offsets = {r["name"]: r["offset"] for r in kernel.record["params"]}

    def unpacked(blob):
        return (
            int.from_bytes(blob[offsets["x"] :][:8], "little"),
            struct.unpack_from("<i", blob, offsets["length"])[0],
            struct.unpack_from("<i", blob, offsets["offset"])[0],
            struct.unpack_from("<f", blob, offsets["scale"])[0],
        )

    template.launch({"x": 0x1000, "offset": 3, "scale": 0.5, "length": 99}, stream=0)
    template.launch({"x": 0x2000, "offset": -4, "scale": 2.0, "length": 99}, stream=0)
    assert [unpacked(b) for b in launched] == [(0x1000, 7, 3, 0.5), (0x2000, 7, -4, 2.0)]
    assert template.grid == (1, 2, 1)


def test_a_template_packs_what_the_packer_packs_and_refuses_a_misaligned_pointer(monkeypatch):
    """The template's buffer (static bytes OR per-call bytes) is the packer's for the same values,
    and a per-call pointer off its alignment is refused before anything launches."""
    from cula_aot.specs import pointer, scalar

    params = (
        pointer("x", "f32"),
        scalar("length", "i32"),
        pointer("y", "f32"),
        scalar("offset", "i32", per_call=True),
        scalar("scale", "f32", per_call=True),
    )
    kernel = LoadedKernel("fake", _fake_record(params), function=None)
    launched = []
    monkeypatch.setattr(
        kernel, "launch_packed", lambda packed, grid, stream, smem_bytes=None, dependent=False: launched.append(packed)
    )
    template = kernel.template({"heads": 2, "length": -7})
    values = {"x": 0xFFFF_FFFF_FFF0, "y": 0x10, "offset": -1, "scale": -0.5, "length": -7}
    template.launch(values, stream=0)
    assert launched == [kernel.packer.pack(values)]
    with pytest.raises(ValueError, match="pointer 'y' is not 16-byte aligned"):
        template.launch({**values, "y": 0x18}, stream=0)
    assert len(launched) == 1
