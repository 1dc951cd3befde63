"""The custom ops' schemas (``cula_aot.torch_op.SCHEMAS``) under ``torch.library.opcheck`` and
``torch.compile`` on the CPU: the same schema strings defined in a scratch namespace with CPU
stand-ins that mutate exactly what the schemas declare mutated and the ops' own fake
implementations, so the declarations (aliasing, mutation, optional arguments, defaults) and the
fakes' shapes are checked without a GPU.  The real ops run the same
checks with their CUDA kernels in ``tests/ops/test_graph_compile_gpu.py``."""

import pytest
import torch

from cula_aot.torch_op import FAKES, SCHEMAS

NAMESPACE = "cula_aot_schema_check"
H = 4


@pytest.fixture(scope="module")
def ops():
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(f"{name}{schema}")

    def prefill(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        lower_bound,
        scale=None,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=None,
        cu_seqlens_cpu=None,
        state_layout="vk",
        intracard_cp=0,
        gate="safe",
    ):
        n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return v * 2, (
            torch.ones(n, q.shape[2], 128, 128) if output_final_state else q.new_empty(0, dtype=torch.float32)
        )

    def pool(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        lower_bound,
        state_pool,
        state_indices,
        scale=None,
        cu_seqlens=None,
        state_layout="vk",
        gate="safe",
    ):
        state_pool.add_(1.0)
        return v * 2

    def decode(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        lower_bound,
        state_pool,
        state_indices,
        intermediate_states,
        scale=None,
        num_tokens=None,
        state_layout="vk",
        gate="safe",
    ):
        state_pool.add_(1.0)
        if intermediate_states is not None:
            intermediate_states.add_(1.0)
        return v * 2

    def layer(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        lower_bound,
        conv_weight,
        conv_state,
        out_gate,
        norm_weight,
        state_pool,
        state_indices,
        conv_bias=None,
        conv_layout="dim",
        norm_eps=1e-5,
        scale=None,
        num_tokens=None,
        state_layout="vk",
        gate="safe",
        beta_sigmoid=True,
        qk_l2norm=True,
        draft_records=None,
        draft_marks=None,
        num_accepted=None,
        verify=False,
    ):
        conv_state.add_(1.0)
        state_pool.add_(1.0)
        for t in (draft_records, draft_marks):
            if t is not None:
                t.add_(1)
        return v * 2

    for name, fn in (
        ("kda_prefill", prefill),
        ("kda_prefill_pool", pool),
        ("kda_decode", decode),
        ("kda_decode_layer", layer),
    ):
        lib.impl(name, fn, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", FAKES[name], lib=lib)
    yield getattr(torch.ops, NAMESPACE)
    lib._destroy()


def _inputs(n=1, t=100):
    q = torch.randn(n, t, H, 128).bfloat16()
    return q, torch.randn(n, t, H).bfloat16(), torch.randn(H), torch.randn(H, 128)


def test_prefill_schema(ops):
    q, beta, a, dt = _inputs()
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)
    torch.library.opcheck(
        ops.kda_prefill.default,
        (q, q, q, q, beta, a, dt, -5.0),
        {"output_final_state": True, "cu_seqlens": cu, "cu_seqlens_cpu": cu},
    )
    torch.library.opcheck(
        ops.kda_prefill.default, (q, q, q, q, beta, None, None, None), {"output_final_state": True, "gate": "softplus"}
    )


def test_pool_and_decode_schemas_declare_their_mutations(ops):
    q, beta, a, dt = _inputs()
    pool, idx = torch.randn(5, H, 128, 128), torch.tensor([3, -1], dtype=torch.int32)
    torch.library.opcheck(ops.kda_prefill_pool.default, (q, q, q, q, beta, a, dt, -5.0, pool, idx))
    qd, bd, _, _ = _inputs(3, 2)
    pool_b, idx3 = torch.randn(6, H, 128, 128).bfloat16(), torch.tensor([4, -1, 0], dtype=torch.int32)
    inter = torch.zeros(3, 2, H, 128, 128).bfloat16()
    torch.library.opcheck(ops.kda_decode.default, (qd, qd, qd, qd, bd, a, dt, -5.0, pool_b, idx3, inter))
    torch.library.opcheck(
        ops.kda_decode.default, (qd, qd, qd, qd, bd, None, None, None, pool_b, idx3, None), {"gate": "softplus"}
    )
    start = pool.clone()
    compiled = torch.compile(lambda *x: ops.kda_prefill_pool(*x) * 1, fullgraph=True)
    assert torch.equal(compiled(q, q, q, q, beta, a, dt, -5.0, pool, idx), q * 2) and torch.equal(pool, start + 1)


def test_layer_schema_declares_its_mutations(ops):
    qd, bd, a, dt = _inputs(3, 2)
    c = H * 128
    weight, conv = torch.randn(3 * c, 4).bfloat16(), torch.randn(6, 3 * c, 3).bfloat16()
    pool, idx = torch.randn(6, H, 128, 128), torch.tensor([4, -1, 0], dtype=torch.int32)
    norm = torch.ones(128).bfloat16()
    layer_args = (qd, qd, qd, qd, bd, a, dt, -5.0, weight, conv, qd, norm, pool, idx)
    torch.library.opcheck(ops.kda_decode_layer.default, layer_args)
    records = torch.zeros(6, 2, 8, H, 6, 128, dtype=torch.bfloat16)
    marks = torch.zeros(6, H, dtype=torch.int32)
    drafts = {"draft_records": records, "draft_marks": marks, "num_accepted": idx.abs(), "verify": True}
    torch.library.opcheck(ops.kda_decode_layer.default, layer_args, drafts)
