"""``python -m cula_aot`` and the torch.library registration (CPU side)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cula_aot  # noqa: F401  (registers the op)
from cula_aot.runtime.manifest import ENV_ARTIFACTS

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cula_aot", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_info_lists_toolchain_and_kernels():
    result = _cli("info")
    assert result.returncode == 0, result.stderr
    for word in ("sm_90a", "CuTeDSL", "ptxas", "k1_prepare", "k2_recurrence", "cp_merge", "any H >= 1"):
        assert word in result.stdout
    assert "head counts" not in result.stdout  # no kernel is built per head count
    gates = next(line for line in result.stdout.splitlines() if line.startswith("gates"))
    assert all(gate in gates for gate in ("safe", "softplus", "precomputed"))


def test_verify_passes_then_fails_on_a_tampered_copy(artifact_copy):
    assert _cli("verify").returncode == 0
    data = json.loads((artifact_copy / "manifest.json").read_text())
    victim = artifact_copy / next(iter(data["kernels"].values()))["cubin"]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    env = {**os.environ, ENV_ARTIFACTS: str(artifact_copy)}
    result = _cli("verify", env=env)
    assert result.returncode == 1 and "MISMATCH" in result.stdout and "build_kernels.py" in result.stdout


def test_op_is_registered_with_a_fake_implementation():
    op = torch.ops.cula_aot.kda_prefill.default
    assert "Tensor q" in str(op._schema) and "intracard_cp" in str(op._schema)
    with FakeTensorMode():
        q = torch.empty(1, 40, 4, 128, dtype=torch.bfloat16)
        beta = torch.empty(1, 40, 4, dtype=torch.bfloat16)
        a_log, dt_bias = torch.empty(4), torch.empty(4, 128)
        cu = torch.tensor([0, 10, 40], dtype=torch.int32)
        o, final = torch.ops.cula_aot.kda_prefill(
            q, q, q, q, beta, a_log, dt_bias, -5.0, output_final_state=True, cu_seqlens=cu
        )
        assert o.shape == q.shape and o.dtype == torch.bfloat16
        assert final.shape == (2, 4, 128, 128) and final.dtype == torch.float32
        _, none = torch.ops.cula_aot.kda_prefill(q, q, q, q, beta, a_log, dt_bias, -5.0)
        assert none.shape == (0,)


def test_decode_op_is_registered_with_a_fake_implementation():
    op = torch.ops.cula_aot.kda_decode.default
    schema = str(op._schema)
    assert "!) state_pool" in schema and "!)? intermediate_states" in schema  # declared mutated
    with FakeTensorMode():
        q = torch.empty(3, 2, 4, 128, dtype=torch.bfloat16)
        beta = torch.empty(3, 2, 4, dtype=torch.bfloat16)
        a_log, dt_bias = torch.empty(4), torch.empty(4, 128)
        pool = torch.empty(5, 4, 128, 128)
        idx = torch.empty(3, dtype=torch.int32)
        o = torch.ops.cula_aot.kda_decode(q, q, q, q, beta, a_log, dt_bias, -5.0, pool, idx, None)
        assert o.shape == q.shape and o.dtype == torch.bfloat16
        flat = torch.empty(6, 4, 128, dtype=torch.bfloat16)
        o3 = torch.ops.cula_aot.kda_decode(
            flat, flat, flat, flat, beta.flatten(0, 1), a_log, dt_bias, -5.0, pool, idx, None, num_tokens=2
        )
        assert o3.shape == flat.shape
