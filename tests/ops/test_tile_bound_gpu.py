"""The tile bound (kernels/tile_bound.py) on K1's workspaces against float64 from the same records,
in every decay regime: its value (within the bf16 roundings of X and the Grams, plus its margin)
and its soundness (never below the spectral norm of the map the record applies)."""

import math

import pytest
import torch

from cula_aot import reference
from cula_aot.layout import decode_k_inter
from cula_aot.ops.prepare import prepare, tile_bounds
from cula_aot.ops.workspace import ARENA
from cula_aot.specs import TILE_BOUND_MARGIN_LOG2
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs, tile_slots

pytestmark = pytest.mark.gpu

LONG_MEMORY = -12.0
LENGTHS = [1, 15, 16, 17, 100, 700]
TOLERANCE_LOG2 = 0.05  # bf16 X and Gram operands: ≤ 0.01 bits in float64 studies


def regime_inputs(regime, total, heads):
    x = standard_inputs(1, total, heads, device="cuda", seed=fresh_seed(), slow_decay=regime == "slow")
    if regime == "mixed":
        x["dt_bias"][:, :4] = LONG_MEMORY
    return x


def record_tiles(ws, slots, heads):
    """The records of ``slots`` (every head) as float64 tiles: kd, kr [n, H, 16, 128], inv [n, H,
    16, 16], gt [n, H, 128], b [n, H, 16]."""
    index = torch.tensor([[h * ws.total_slots + s for h in range(heads)] for s in slots], device=ws.kd.device)
    tiles = {name: ws.views[name][index].double() for name in ("kd", "kr", "inv", "gt", "b")}
    for name in ("kd", "kr"):
        tiles[name] = decode_k_inter(tiles[name])
    tiles["inv"] = tiles["inv"].view(*index.shape, 16, 16)
    return tiles


def triangle_log2(tiles):
    """log2(‖gtot‖ + ‖krᵀ·X‖_F) in float64 (the kernel's formula before its margin)."""
    x = tiles["inv"] @ (tiles["b"][..., None] * tiles["kd"])
    inner = ((tiles["kr"] @ tiles["kr"].transpose(-1, -2)) * (x @ x.transpose(-1, -2))).sum((-1, -2))
    return torch.log2(tiles["gt"].norm(dim=-1) + inner.clamp(min=0).sqrt())


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("regime", ["standard", "mixed", "slow"])
def test_tile_bound_matches_float64_and_is_sound(regime, varlen):
    heads = 3
    lengths = LENGTHS if varlen else [700, 700]
    x = regime_inputs(regime, sum(lengths), heads)
    cu = cu_seqlens_of(lengths, "cuda") if varlen else None
    q, k, g, beta = (x[n] if varlen else x[n].view(2, 700, *x[n].shape[2:]) for n in ("q", "k", "g", "beta"))
    device = q.device
    ARENA.buffer(device, 1, torch.cuda.current_stream(device).cuda_stream).fill_(0xFF)  # poison
    ws = prepare(q, k, g, beta, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"], cu_seqlens=cu)
    bounds = tile_bounds(ws, heads, device)
    torch.cuda.synchronize()
    slots = tile_slots(lengths) if varlen else tile_slots(2, 700)
    got = bounds[:, slots].T.double().cpu()  # [n, H]
    tiles = record_tiles(ws, slots, heads)
    assert torch.isfinite(got).all() or (got[~torch.isfinite(got)] < 0).all()
    want = triangle_log2({n: t.cpu() for n, t in tiles.items()}) + TILE_BOUND_MARGIN_LOG2
    tiny = want < -100  # beyond fp32's reach: both far below any certificate
    assert ((got - want).abs()[~tiny] <= TOLERANCE_LOG2).all(), float((got - want).abs()[~tiny].max())
    assert (got[tiny] < -90).all()
    # Sound: never below the spectral norm of the map these records apply.
    maps = reference.tile_transition({n: t.cpu() for n, t in tiles.items()})
    spectral = torch.linalg.matrix_norm(maps, ord=2).log2()
    assert (got >= spectral - 1e-6).all(), float((spectral - got).max())
    if regime == "standard":  # the premise of short warm-ups: two tiles certify ~always
        full = torch.tensor([min(16, n - 16 * j) for n in lengths for j in range(math.ceil(n / 16))]) == 16
        pair = (got[:-1] + got[1:])[full[:-1] & full[1:]]
        assert (pair <= reference.TRUNCATION_LOG2).double().mean() >= 0.8
