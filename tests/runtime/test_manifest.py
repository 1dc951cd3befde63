"""The built manifest: schema, coverage, sha256 and ABI of every artifact (CPU only)."""

import hashlib
import importlib.metadata

from cula_aot.compiler.cubin import check_cubin_abi
from cula_aot.runtime.manifest import SCHEMA_VERSION, Manifest
from cula_aot.specs import (
    ARCH,
    DecodeChunkSpec,
    DecodeLayerSpec,
    DecodeSpec,
    FusedSpec,
    FusedPiecesSpec,
    K1Spec,
    K2Spec,
    MergeSpec,
    TileBoundSpec,
    abi_layout,
    default_specs,
)

SPEC_CLASSES = {
    cls.kernel: cls
    for cls in (
        K1Spec,
        K2Spec,
        FusedSpec,
        FusedPiecesSpec,
        MergeSpec,
        TileBoundSpec,
        DecodeSpec,
        DecodeChunkSpec,
        DecodeLayerSpec,
    )
}


def test_schema_and_toolchain(manifest):
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["arch"] == ARCH
    try:
        installed = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        installed = None  # a runtime-only install: nothing to compare with
    assert installed in (None, manifest["cutedsl_version"])
    assert manifest["distributions"]["nvidia-cutlass-dsl"] == manifest["cutedsl_version"]
    assert manifest["ptxas_version"] and manifest["source_sha256"] and manifest["package_version"]


def test_every_default_specialization_is_built(manifest):
    # No specialization names a head count: each kernel serves every H (the grid's).
    assert {spec.name for spec in default_specs()} <= set(manifest["kernels"])
    assert not any("heads" in record["args"] for record in manifest["kernels"].values())


def test_every_artifact_exists_matches_sha256_and_abi(manifest, manifest_path):
    root = manifest_path.parent
    for name, record in manifest["kernels"].items():
        spec = SPEC_CLASSES[record["kernel"]](**record["args"])
        assert spec.name == name
        path = root / record["cubin"]
        assert path.parts[-3:-1] == (manifest["cutedsl_version"], ARCH)
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == record["sha256"] and len(data) == record["size"]
        assert record["entry"].encode() in data
        declared = abi_layout(spec.params)
        assert [{**p, "offset": None} for p in record["params"]] == [{**p, "offset": None} for p in declared]
        check_cubin_abi(name, data, record["entry"], record["params"], record["param_bytes"], record["block"])
        descriptors = [p for p in record["params"] if p["kind"] == "tma_descriptor"]
        assert [p["recipe"]["source"] for p in descriptors] == (
            ["q", "k", "g"] if spec.kernel in ("k1_prepare", "fused_prefill", "fused_pieces") else []
        )
        assert all(p["offset"] % 16 == 0 and p["size"] == 128 for p in descriptors)
        assert record["grid"] == list(spec.grid) and record["dynamic_smem_bytes"] <= 227 * 1024


def test_manifest_record_lookup(manifest_path):
    m = Manifest(manifest_path)
    name, record = m.record(K1Spec(varlen=True))
    assert name == "k1_prepare_varlen1_gatesafe" and record["args"] == {"varlen": True, "gate": "safe"}
    name, record = m.record(K2Spec(varlen=False, v_block=16))
    assert record["args"] == {
        "varlen": False,
        "v_block": 16,
        "segmented": False,
        "prescan": False,
        "stages": 3,
        "multicast": False,
        "wgmma": False,
        "walk": False,
        "checkpointing": False,
    }


def test_decode_launches_ask_for_what_their_token_count_uses(manifest):
    """A decode launch asks for the shared memory of its T (the per-token arrays are packed for
    the runtime T): T = DECODE_MAX_TOKENS is exactly the built maximum, fewer tokens strictly less,
    and nothing ever exceeds what the kernel was built for."""
    from cula_aot.specs import DECODE_MAX_TOKENS, DecodeSpec

    decode = [(name, r) for name, r in manifest["kernels"].items() if r["kernel"] == "kda_decode"]
    assert decode
    for name, record in decode:
        spec = DecodeSpec(**record["args"])
        sizes = [spec.launch_smem_bytes(t) for t in range(1, DECODE_MAX_TOKENS + 1)]
        assert sizes == sorted(set(sizes)), name
        assert sizes[-1] == record["dynamic_smem_bytes"], name


def test_layer_launches_ask_for_their_tokens_and_the_commit_replay(manifest):
    """The fused layer's launches: the per-token arrays of T, and with drafts the commit's replay
    arrays behind them (``DRAFT_REPLAY_BYTES``); 8 tokens with drafts is the built maximum."""
    from cula_aot.specs import DECODE_MAX_TOKENS, DRAFT_REPLAY_BYTES, DecodeLayerSpec

    layers = [(name, r) for name, r in manifest["kernels"].items() if r["kernel"] == "kda_decode_layer"]
    assert layers
    for name, record in layers:
        spec = DecodeLayerSpec(**record["args"])
        plain = [spec.launch_smem_bytes(t, drafts=False) for t in range(1, DECODE_MAX_TOKENS + 1)]
        drafts = [spec.launch_smem_bytes(t, drafts=True) for t in range(1, DECODE_MAX_TOKENS + 1)]
        assert plain == sorted(set(plain)), name
        assert [d - p for d, p in zip(drafts, plain)] == [DRAFT_REPLAY_BYTES] * DECODE_MAX_TOKENS, name
        assert drafts[-1] == record["dynamic_smem_bytes"], name
