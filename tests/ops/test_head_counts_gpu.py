"""Every head count from 1 to 128 runs from the one set of cubins (H is the launch grid's), on
every path, against the float64 references: the serial prefill and token decode for each H;
the fused kernel, intracard CP, decode with per-token states and the chunk decode kernel for
the production shards and the edges."""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops.prefill import prefill
from tests.decode_helpers import decode_reference, from_pool_layout, to_pool_layout
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 1e-2
SHARDS = (1, 3, 5, 6, 12, 24, 127, 128)


def _prefill_error(heads: int, **options) -> tuple:
    lengths = [33, 64]
    inputs = standard_inputs(1, sum(lengths), heads, device="cuda", slow_decay=True)
    cu = cu_seqlens_of(lengths, "cuda")
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    s0 = (0.1 * torch.randn(len(lengths), heads, 128, 128, generator=gen)).cuda()
    out = torch.full_like(inputs["v"], float("nan"))
    final = torch.full_like(s0, float("nan"))
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    gate = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=inputs["lower_bound"])
    prefill(
        *args,
        **gate,
        initial_state=s0.transpose(-1, -2).contiguous(),
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.cpu(),
        out=out,
        final_state=final,
        **options,
    )
    ref_o, ref_s = reference.kda_chunked(*args, **gate, initial_state=s0, cu_seqlens=cu)
    return reference.rel_rmse(out, ref_o), reference.rel_rmse(final.transpose(-1, -2), ref_s)


def _decode_error(heads: int, tokens: int, bf16: bool, intermediates: bool) -> tuple:
    n, slots = 3, 5
    inputs = standard_inputs(n, tokens, heads, device="cuda")
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed())
    s0 = 0.1 * torch.randn(n, heads, 128, 128, generator=gen, dtype=torch.float64)
    dtype = torch.bfloat16 if bf16 else torch.float32
    pool = torch.full((slots, heads, 128, 128), float("nan"), dtype=dtype, device="cuda")
    indices = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    pool[indices.long()] = to_pool_layout(s0, "vk").to(device="cuda", dtype=dtype)
    start = from_pool_layout(pool[indices.long()].to(torch.float64), "vk").cpu()
    inter = (
        torch.full((n, tokens, heads, 128, 128), float("nan"), dtype=dtype, device="cuda") if intermediates else None
    )
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    gate = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=inputs["lower_bound"])
    o = cula_aot.kda_decode(*args, **gate, state_pool=pool, state_indices=indices, intermediate_states=inter)
    ref_o, ref_states = decode_reference(
        *(x.cpu() for x in args),
        A_log=inputs["A_log"].cpu(),
        dt_bias=inputs["dt_bias"].cpu(),
        lower_bound=inputs["lower_bound"],
        initial_state=start,
    )
    errors = [
        reference.rel_rmse(o.cpu(), ref_o),
        reference.rel_rmse(from_pool_layout(pool[indices.long()].float(), "vk").cpu(), ref_states[:, -1]),
    ]
    if intermediates:
        errors.append(reference.rel_rmse(from_pool_layout(inter.float(), "vk").cpu(), ref_states))
    return tuple(errors)


def test_serial_prefill_and_decode_for_every_head_count():
    worst = {"prefill": 0.0, "decode": 0.0}
    for heads in range(1, 129):
        errors = _prefill_error(heads, intracard_cp=False, fused=False)
        assert max(errors) <= BOUND, f"H={heads} serial prefill: o, state rel-RMSE {errors}"
        worst["prefill"] = max(worst["prefill"], *errors)
        errors = _decode_error(heads, tokens=1, bf16=False, intermediates=False)
        assert max(errors) <= BOUND, f"H={heads} decode: o, state rel-RMSE {errors}"
        worst["decode"] = max(worst["decode"], *errors)
    print(f"H = 1..128: worst rel-RMSE serial prefill {worst['prefill']:.2e}, decode {worst['decode']:.2e}")


@pytest.mark.parametrize("heads", SHARDS)
def test_fused_cp_and_decode_variants_for_shard_head_counts(heads):
    report = []
    for label, options in (("fused", dict(intracard_cp=False, fused=True)), ("cp", dict(intracard_cp=2))):
        errors = _prefill_error(heads, **options)
        assert max(errors) <= BOUND, f"H={heads} {label}: o, state rel-RMSE {errors}"
        report.append(f"{label} {max(errors):.2e}")
    for label, tokens, bf16, intermediates in (
        ("decode T=3 bf16 chunk", 3, True, False),
        ("decode T=4 fp32 intermediates", 4, False, True),
    ):
        errors = _decode_error(heads, tokens, bf16, intermediates)
        assert max(errors) <= BOUND, f"H={heads} {label}: rel-RMSE {errors}"
        report.append(f"{label} {max(errors):.2e}")
    print(f"H={heads}: " + ", ".join(report))
