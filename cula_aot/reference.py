"""Pure-torch float64 reference of the KDA chunked prefill (docs/CONTRACT.md §2).

This module is the ground truth the kernels are checked against (docs/CONTRACT.md §8). It has no
dependency beyond torch and runs on whatever device its inputs live on (CPU or CUDA).

Math (per head, D = K = V = 128, CHUNK = 16), all in float64 unless the precision recipe says
otherwise:

* gate: ``γ = lower_bound · σ(exp(A_log) · (g + dt_bias))`` per key dim ("safe"; or
  ``−exp(A_log) · softplus(g + dt_bias)``, "softplus", or ``min(g, 0)``, "precomputed": see
  :func:`gate`), a natural-log decay: the state is multiplied by ``exp(γ)`` (per key row) at
  every token.
* ``q̂ = q · rsqrt(Σq² + 1e-6)``, ``k̂`` likewise, **rounded to bf16** (part of the semantics in
  every mode, see :func:`l2norm_bf16`); ``b = σ(β)``.
* Each sequence is cut into 16-row tiles from its start; rows past the end of a partial last tile
  behave as ``q = k = v = 0, γ = 0, β = -inf`` (so ``b = 0`` and the row changes nothing).
  Per tile, with ``G`` the inclusive cumsum of γ over the rows and ``gtot = exp(G[15])``::

      qd = q̂·e^G·scale   kd = k̂·e^G   kinv = k̂·e^-G   kr = k̂·gtot·e^-G
      L   = strict_lower(diag(b)·kd·kinvᵀ)      mqk = lower_incl_diag(qd·kinvᵀ)
      INV = (I + L)^-1

  and the tile recurrence on the state ``S`` ([K, V], per sequence and head)::

      W = diag(b)·(V − kd·S)    U = INV·W
      O = qd·S + mqk·U          S ← diag(gtot)·S + krᵀ·U

Why the tile form equals the token recurrence of :func:`kda_recurrent` (decay, then delta rule
``S ← S + b_t k̂_t (v_t − Sᵀk̂_t)ᵀ``, then ``o_t = scale·Sᵀq̂_t``): write the update of token r as
``u_r = b_r (v_r − S'ᵀ k̂_r)`` where ``S'`` is the decayed state seen by token r,
``S' = e^{G_r}⊙S_0 + Σ_{i<r} (e^{G_r−G_i}⊙k̂_i) u_iᵀ``. Then
``u_r = b_r (v_r − kd_r S_0 − Σ_{i<r} (kd_r·kinv_i) u_i)``, i.e. ``(I + L) U = W``; the output
``o_r = qd_r S_0 + Σ_{i≤r} (qd_r·kinv_i) u_i = (qd S_0 + mqk U)_r`` and the end state
``diag(gtot) S_0 + Σ_i (gtot e^{−G_i}⊙k̂_i) u_iᵀ = diag(gtot) S_0 + krᵀ U``.

``recipe=True`` mirrors the FlashKDA/cuLA precision recipe instead of exact math; every rounding
point is listed in :func:`prepare_tiles` and :func:`kda_chunked`. Values are still returned as
float64 tensors (holding the rounded values), so the two modes compare directly.

Sequence layout: without ``cu_seqlens`` each of the B batch rows is one sequence of length T; with
``cu_seqlens`` (B must be 1) the sequences are the slices ``[cu[n], cu[n+1])`` of the T axis.
States are ``[N, H, K, V]`` (S itself, not the transposed public ``[N, H, V, K]`` layout).

:func:`kda_decode_layer` is the step of a fused decode-layer kernel: the token recurrence with fla's KDA
layer around it (short convolution before, gated RMSNorm after), states in the "vk" layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .gates import DEFAULT_GATE, bounded, log_decay

from .layout import (
    CHUNK,
    FLAG_FINAL_STATE,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_PREDECESSOR,
    SEG_SEQ,
    SEG_SEQ_OFFSET,
    SEG_TOKENS,
)
from .specs import TRUNCATION_LOG2  # a piece's warm-up attenuates the state it drops by 2^-20

__all__ = [
    "CHUNK",
    "gate",
    "conventions",
    "l2norm_bf16",
    "prepare_tiles",
    "kda_chunked",
    "kda_recurrent",
    "kda_decode_layer",
    "rel_rmse",
]

_NORM_EPS = 1e-6


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` (round-to-nearest-even) and hand it back as float64."""
    return x.to(dtype).to(torch.float64)


# The gate's float64 formula lives with the gate (``cula_aot.gates``).
gate = log_decay


def l2norm_bf16(x):
    """``x · rsqrt(Σx² + 1e-6)`` over the last dim, computed in float64, rounded to bf16.

    The result is returned as float64 holding bf16 values: the bf16 rounding of q̂/k̂ is part of
    the contract's semantics (CONTRACT §2), so even the exact reference uses the rounded vectors.
    """
    x = x.to(torch.float64)
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _NORM_EPS)
    return _round(y, torch.bfloat16)


def conventions(q, k, beta, beta_sigmoid=True, qk_l2norm=True):
    """q̂, k̂ and b as float64 under the kernels' input conventions: q, k L2-normalised and rounded
    to bf16 (:func:`l2norm_bf16`) or as given; b = σ(β) of logits or β itself."""
    qn, kn = ((l2norm_bf16(x) if qk_l2norm else x.to(torch.float64)) for x in (q, k))
    beta = beta.to(torch.float64)
    return qn, kn, (torch.sigmoid(beta) if beta_sigmoid else beta)


class _Layout(NamedTuple):
    """Where each sequence and tile lives on the flattened ``B·T`` token axis."""

    starts: list[int]  # first flat token of each sequence
    lengths: list[int]  # tokens per sequence
    tile_first: list[int]  # index of each sequence's first tile
    tile_count: list[int]  # tiles per sequence
    tile_seq: torch.Tensor  # int64 [n_tiles]
    tile_index: torch.Tensor  # int64 [n_tiles]
    tile_rows: torch.Tensor  # int64 [n_tiles], valid rows 1..16
    token: torch.Tensor  # int64 [n_tiles, 16] flat token of each row (padded rows: any valid one)
    valid: torch.Tensor  # bool [n_tiles, 16]


def _layout(B: int, T: int, cu_seqlens, device) -> _Layout:
    if cu_seqlens is None:
        starts, lengths = [b * T for b in range(B)], [T] * B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(e < s for s, e in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}: {cu}")
        starts, lengths = cu[:-1], [e - s for s, e in zip(cu, cu[1:])]

    tile_first, tile_count, seq, index, first_token = [], [], [], [], []
    for n, (start, length) in enumerate(zip(starts, lengths)):
        count = -(-length // CHUNK)
        tile_first.append(len(seq))
        tile_count.append(count)
        for j in range(count):
            seq.append(n)
            index.append(j)
            first_token.append(start + j * CHUNK)
    rows = [min(CHUNK, lengths[n] - j * CHUNK) for n, j in zip(seq, index)]

    def long(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    tile_rows = long(rows)
    offsets = torch.arange(CHUNK, dtype=torch.int64, device=device)
    valid = offsets[None, :] < tile_rows[:, None]
    first = long(first_token)[:, None]
    token = torch.where(valid, first + offsets[None, :], first)
    return _Layout(starts, lengths, tile_first, tile_count, long(seq), long(index), tile_rows, token, valid)


def _steps(firsts: list[int], counts: list[int], device):
    """For each step j: (sequences with more than j items, flat id of their item j).

    Lets a sequential loop run over all sequences at once, however their lengths differ.
    """
    out = []
    for j in range(max(counts, default=0)):
        seqs = [n for n, c in enumerate(counts) if c > j]
        ids = [firsts[n] + j for n in seqs]
        out.append(
            (torch.tensor(seqs, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device))
        )
    return out


def _to_tiles(x: torch.Tensor, lay: _Layout, fill: float) -> torch.Tensor:
    """Gather a flat per-token tensor ``[B·T, H, ...]`` into tiles ``[n_tiles, H, 16, ...]``."""
    t = x[lay.token]  # [n_tiles, 16, H, ...]
    mask = lay.valid.view(*lay.valid.shape, *([1] * (t.dim() - 2)))
    t = torch.where(mask, t, torch.full((), fill, dtype=t.dtype, device=t.device))
    return t.transpose(1, 2)


def _neumann_inverse_fp16(L: torch.Tensor) -> torch.Tensor:
    """``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` with L, every power, factor and partial product in fp16.

    Exact for strictly lower 16×16 L (L¹⁶ = 0); the products are taken in float64 and each result
    rounded to fp16, modelling fp16 operands with a rounded fp16 store after every matmul.
    """

    def f16(x):
        return _round(x, torch.float16)

    eye = torch.eye(CHUNK, dtype=torch.float64, device=L.device)
    L1 = f16(L)
    L2 = f16(L1 @ L1)
    L4 = f16(L2 @ L2)
    L8 = f16(L4 @ L4)
    P = f16(f16(eye - L1) @ f16(eye + L2))
    P = f16(P @ f16(eye + L4))
    return f16(P @ f16(eye + L8))


def _pairwise_products(a, kn, G):
    """``a_i · Σ_k kn_jk · exp(G_ik − G_jk)`` for j ≤ i (0 above the diagonal), ``[n, H, 16, 16]``:
    each pair's decay formed from its own exponent, never as exp(G)·exp(−G), so no decay rate
    can overflow.  Tiles are taken in groups to bound the [16, 16, K] exponent tensors."""
    out = torch.zeros(*a.shape[:-1], a.shape[-2], dtype=torch.float64, device=a.device)
    lower = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=a.device))
    for s in range(0, a.shape[0], 64):
        diff = G[s : s + 64, :, :, None, :] - G[s : s + 64, :, None, :, :]  # [n, H, i, j, K]
        decay = torch.exp(diff.clamp(max=0.0)) * lower[:, :, None]
        out[s : s + 64] = torch.einsum("nhik,nhjk,nhijk->nhij", a[s : s + 64], kn[s : s + 64], decay)
    return out


def prepare_tiles(
    q,
    k,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    cu_seqlens=None,
    recipe=False,
    gate_kind=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """Per-(tile, head) quantities of CONTRACT §2 (what kernel K1 writes), as float64 tensors.

    q, k, g bf16 ``[B, T, H, K]``; beta bf16 ``[B, T, H]`` (logits); A_log fp32 ``[H]``; dt_bias fp32
    ``[H, K]``; scale defaults to ``K ** -0.5`` (128**-0.5). Tiles are ordered sequence by
    sequence, tile by tile. Returns a dict:

    * ``qd, kd, kinv, kr``: ``[n_tiles, H, 16, K]``
    * ``gt``: ``[n_tiles, H, K]``, ``gtot = exp(G[15])``, the decay of the whole tile
    * ``L, inv, mqk``: ``[n_tiles, H, 16, 16]``
    * ``b``: ``[n_tiles, H, 16]`` = σ(β) (0 on padded rows); ``beta``: the raw logits (−inf there)
    * ``gamma``, ``kn``: ``[n_tiles, H, 16, K]``, each row's log-decay and k̂ (0 on padded rows)
    * ``tile_seq, tile_index, tile_rows``: int64 ``[n_tiles]``: sequence, tile number in the
      sequence, valid rows (1..16)

    ``recipe=True`` rounds as the precision recipe does, and only at these points:
    qd, kd, kinv, kr to bf16 (L and mqk are then formed in float64 from the rounded values);
    gt to fp32; mqk to bf16; L is returned unrounded but enters the inverse as fp16, and the
    inverse is :func:`_neumann_inverse_fp16` (every factor and partial product fp16) rounded to
    bf16 at the end. γ, G, b and the exponentials stay float64 (the kernel's fp32 math there is
    well below the bf16 rounding that follows).

    ``gate_kind`` (:func:`gate`): under the unbounded gates L and mqk are formed pair by pair
    (:func:`_pairwise_products`) and ``kinv`` may overflow (it is returned but not used).
    ``beta_sigmoid``, ``qk_l2norm``: the input conventions (:func:`conventions`).
    """
    B, T, H, K = q.shape
    if scale is None:
        scale = K**-0.5
    lay = _layout(B, T, cu_seqlens, q.device)

    def flat(x):
        return x.reshape(B * T, *x.shape[2:])

    gam = _to_tiles(flat(gate(g, A_log, dt_bias, lower_bound, gate_kind)), lay, 0.0)
    qn, kn, b = conventions(q, k, beta, beta_sigmoid, qk_l2norm)
    qn, kn = _to_tiles(flat(qn), lay, 0.0), _to_tiles(flat(kn), lay, 0.0)
    logit = _to_tiles(flat(beta.to(torch.float64)), lay, -math.inf)  # [n_tiles, H, 16]
    b = _to_tiles(flat(b), lay, 0.0)

    G = torch.cumsum(gam, dim=2)
    G_end = G[:, :, -1:, :]
    gt = torch.exp(G_end[:, :, 0, :])
    qd = qn * torch.exp(G) * scale
    kd = kn * torch.exp(G)
    kinv = kn * torch.exp(-G)
    kr = kn * torch.exp(G_end - G)  # = k̂·gtot·e^-G without forming e^-G·e^G_end separately
    if recipe:
        qd, kd, kinv, kr = (_round(x, torch.bfloat16) for x in (qd, kd, kinv, kr))
        gt = _round(gt, torch.float32)

    if bounded(gate_kind):
        L = torch.tril(b[..., :, None] * (kd @ kinv.transpose(-1, -2)), diagonal=-1)
        mqk = torch.tril(qd @ kinv.transpose(-1, -2))
    else:
        L = torch.tril(b[..., :, None] * _pairwise_products(kn, kn, G), diagonal=-1)
        mqk = _pairwise_products(qn * scale, kn, G)
    if recipe:
        mqk = _round(mqk, torch.bfloat16)
        inv = _round(_neumann_inverse_fp16(L), torch.bfloat16)
    else:
        eye = torch.eye(CHUNK, dtype=torch.float64, device=q.device).expand_as(L)
        inv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)

    return {
        "qd": qd,
        "kd": kd,
        "kinv": kinv,
        "kr": kr,
        "gt": gt,
        "L": L,
        "inv": inv,
        "mqk": mqk,
        "b": b,
        "beta": logit,
        "gamma": gam,
        "kn": kn,
        "tile_seq": lay.tile_seq,
        "tile_index": lay.tile_index,
        "tile_rows": lay.tile_rows,
    }


def _tiled(q, k, v, g, beta, cu_seqlens, **options):
    """What the tile recurrences start from: :func:`prepare_tiles` of the inputs (``options``: its
    keyword arguments), the sequence layout, and v as tiles ``[n_tiles, H, 16, V]``."""
    B, T, H, _ = q.shape
    tiles = prepare_tiles(q, k, g, beta, cu_seqlens=cu_seqlens, **options)
    lay = _layout(B, T, cu_seqlens, q.device)
    return tiles, lay, _to_tiles(v.to(torch.float64).reshape(B * T, H, v.shape[-1]), lay, 0.0)


def _initial_state(initial_state, N, H, K, V, device):
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=torch.float64, device=device)
    if tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {[N, H, K, V]}, got {list(initial_state.shape)}")
    return initial_state.to(torch.float64).clone()


def kda_chunked(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    recipe=False,
    gate_kind=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """Tile recurrence of CONTRACT §2 -> ``(o [B, T, H, V], final_state [N, H, K, V])``, float64.

    initial_state: optional ``[N, H, K, V]`` (fp32), S itself, not transposed; None = zeros.
    All sequences and heads advance together, one tile index per step; sequences that have run
    out of tiles simply drop out of later steps.

    ``recipe=True`` uses :func:`prepare_tiles` with ``recipe=True`` and additionally rounds:
    the state operand of ``kd·S`` and ``qd·S`` to bf16 (the state itself is carried in fp32:
    ``diag(gtot)·S + krᵀ·U`` is rounded to fp32 after every tile); W and U to bf16 before the
    matmuls that consume them; o to bf16 at the end. V is bf16 already.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    gates = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate_kind=gate_kind)
    conventions = dict(scale=scale, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm)
    tiles, lay, vt = _tiled(q, k, v, g, beta, cu_seqlens, recipe=recipe, **gates, **conventions)
    N = len(lay.lengths)

    def bf16(x):
        return _round(x, torch.bfloat16) if recipe else x

    S = _initial_state(initial_state, N, H, K, Vd, q.device)
    if recipe:
        S = _round(S, torch.float32)
    o_tiles = torch.zeros_like(vt)
    for seqs, ids in _steps(lay.tile_first, lay.tile_count, q.device):
        qd, kd, kr = tiles["qd"][ids], tiles["kd"][ids], tiles["kr"][ids]
        b, gt = tiles["b"][ids], tiles["gt"][ids]
        s = S[seqs]
        s_op = bf16(s)
        W = bf16(b[..., None] * (vt[ids] - kd @ s_op))
        U = bf16(tiles["inv"][ids] @ W)
        o_tiles[ids] = qd @ s_op + tiles["mqk"][ids] @ U
        s = gt[..., None] * s + kr.transpose(-1, -2) @ U
        S[seqs] = _round(s, torch.float32) if recipe else s

    o = _untiled(o_tiles, lay, B * T)
    return bf16(o).view(B, T, H, Vd), S


def _tile_x(tiles) -> torch.Tensor:
    """``X = INV·diag(b)·kd`` per tile [n_tiles, H, 16, K]: the tile map is diag(gtot) − krᵀ·X."""
    return tiles["inv"] @ (tiles["b"][..., None] * tiles["kd"])


def tile_transition(tiles) -> torch.Tensor:
    """Each tile's map of the state it receives, ``A = diag(gtot) − krᵀ·INV·diag(b)·kd``, as
    ``[n_tiles, H, K, K]`` (the tile recurrence with V = 0: ``S ← A·S``)."""
    return torch.diag_embed(tiles["gt"]) - tiles["kr"].transpose(-1, -2) @ _tile_x(tiles)


def _tile_step(tiles, vt, j: int, h: int, s):
    """Tile ``j`` of head ``h`` from state ``s`` [K, V], float64: (its output [16, V], the state
    after it), the tile recurrence of :func:`kda_chunked` without its roundings."""
    u = tiles["inv"][j, h] @ (tiles["b"][j, h, :, None] * (vt[j, h] - tiles["kd"][j, h] @ s))
    return tiles["qd"][j, h] @ s + tiles["mqk"][j, h] @ u, tiles["gt"][j, h, :, None] * s + tiles["kr"][j, h].T @ u


def _untiled(o_tiles, lay, tokens: int):
    """Tile outputs ``[n_tiles, H, 16, V]`` back on the flat token axis ``[tokens, H, V]``."""
    o = torch.zeros(tokens, *o_tiles.shape[1:2], o_tiles.shape[-1], dtype=torch.float64, device=o_tiles.device)
    o[lay.token[lay.valid]] = o_tiles.transpose(1, 2)[lay.valid]
    return o


def tile_frobenius_bound(tiles) -> torch.Tensor:
    """log2 ‖A‖_F of each tile map (:func:`tile_decay_bound`'s Frobenius part), ``[n_tiles, H]``."""
    gt, kr, x = tiles["gt"], tiles["kr"], _tile_x(tiles)
    frobenius_sq = (
        (gt * gt).sum(-1)
        - 2.0 * (gt * (kr * x).sum(-2)).sum(-1)
        + ((kr @ kr.transpose(-1, -2)) * (x @ x.transpose(-1, -2))).sum((-1, -2))
    )
    return 0.5 * torch.log2(frobenius_sq.clamp(min=torch.finfo(torch.float64).tiny))


def tile_decay_bound(tiles) -> torch.Tensor:
    """log2 of an upper bound of each tile map's spectral norm ‖A‖₂ (:func:`tile_transition`),
    ``[n_tiles, H]``: the smaller of two sound bounds, neither assuming normalised keys or b ∈ [0, 1].

    * Frobenius, from 16×16 Gram matrices (no K×K product): with ``X = INV·diag(b)·kd``,
      ``‖A‖_F² = Σ gtot² − 2·Σ_d gtot_d·(krᵀX)_dd + ⟨kr·krᵀ, X·Xᵀ⟩``.  Tight where every channel
      forgets within the tile (standard decay).
    * Token by token: ``A = Π_r (I − b_r k̂_r k̂_rᵀ)·diag(e^γ_r)`` and ``‖I − b k̂ k̂ᵀ‖₂ =
      max(1, |1 − b‖k̂‖²|)``, so ``log2 ‖A‖₂ ≤ Σ_r (max_d γ_r,d·log2 e + log2 max(1, |1 − b_r‖k̂_r‖²|))``.
      Free of the Frobenius norm's √K: tight where every channel decays slowly alike.

    Spectral norms multiply sub-multiplicatively, so the sum of these over consecutive tiles
    bounds log2 ‖M‖₂ of their product M: the factor by which a state dropped before them can
    still reach the state after them."""
    frobenius = tile_frobenius_bound(tiles)
    kn = tiles["kn"]
    mixing = (1.0 - tiles["b"] * (kn * kn).sum(-1)).abs().clamp(min=1.0)
    tokens = (tiles["gamma"].amax(-1) / math.log(2.0) + torch.log2(mixing)).sum(-1)
    return torch.minimum(frobenius, tokens)


def kda_pieces(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    piece_tiles,
    max_warmup=None,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    gate_kind=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """The tile recurrence run as pieces of ``piece_tiles`` tiles per (sequence, head) chain ->
    ``(o [B, T, H, V], final_state [N, H, K, V], warmup [n_pieces, H])``, float64.

    A piece starting at tile c0 > 0 walks back over the tiles before it, summing
    :func:`tile_decay_bound`, until the sum is ≤ ``TRUNCATION_LOG2``; it then starts from a zero
    state that many tiles back (a free piece): the state it drops reaches c0 attenuated by at most
    2^-20.  A walk longer than ``max_warmup`` tiles (None: no limit) or one that reaches the
    sequence's start does not certify: the piece starts at c0 from the end state of the piece
    before it (an exact carry, as CP's affine summaries or a look-back deliver it; the first piece
    from the sequence's initial state).  Warm-up tiles write no output; a sequence's last piece
    writes its final state.  ``warmup``: the tiles each piece walked back, 0 for a carried one."""
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    gates = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate_kind=gate_kind)
    conventions = dict(scale=scale, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm)
    tiles, lay, vt = _tiled(q, k, v, g, beta, cu_seqlens, **gates, **conventions)
    bounds = tile_decay_bound(tiles)
    N = len(lay.lengths)
    S0 = _initial_state(initial_state, N, H, K, Vd, q.device)
    final = S0.clone()
    o_tiles = torch.zeros_like(vt)
    warmups = []
    reach = math.inf if max_warmup is None else max_warmup
    for n, (first, count) in enumerate(zip(lay.tile_first, lay.tile_count)):
        carried = S0[n].clone()  # the exact state at the next piece's first tile
        for c0 in range(0, count, piece_tiles):
            c1 = min(c0 + piece_tiles, count)
            walked = torch.zeros(H, dtype=torch.int64)
            for h in range(H):
                acc = bounds[first : first + c0, h].flip(0).cumsum(0)  # over the c0 − j tiles back
                hit = (acc <= TRUNCATION_LOG2).nonzero()
                w = int(hit[0]) + 1 if len(hit) and int(hit[0]) + 1 <= reach else 0
                walked[h] = w
                s = torch.zeros_like(S0[n, h]) if w else carried[h]
                for j in range(first + c0 - w, first + c1):
                    o_j, s = _tile_step(tiles, vt, j, h, s)
                    if j >= first + c0:
                        o_tiles[j, h] = o_j
                carried[h] = s
                if c1 == count:
                    final[n, h] = s
            warmups.append(walked)
    o = _untiled(o_tiles, lay, B * T)
    return o.view(B, T, H, Vd), final, torch.stack(warmups) if warmups else torch.zeros(0, H, dtype=torch.int64)


def kda_piece_table(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    rows,
    warmup_tiles,
    margin_log2=0.0,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    gate_kind=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """The fused pieces' rule over their table, float64 -> ``(o, final_state [N, H, K, V],
    certified [rows, H] (bool))``.  ``rows``: segment rows in launch order (``layout.SEG_*``, the
    predecessor's row in ``SEG_PREDECESSOR``).  A row whose piece starts at tile c0 of its
    sequence runs w = min(warmup_tiles, c0) tiles before it without output: from the sequence's
    initial state where w = c0 (exact); else from zero, kept where the tiles' Frobenius bounds
    (:func:`tile_frobenius_bound`, plus ``margin_log2`` each, as the kernel adds) sum to ≤
    ``TRUNCATION_LOG2`` (certified), replaced at c0 by the predecessor's end state otherwise.  A
    row with the final-state flag writes its sequence's final state."""
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    gates = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate_kind=gate_kind)
    conventions = dict(scale=scale, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm)
    tiles, lay, vt = _tiled(q, k, v, g, beta, cu_seqlens, **gates, **conventions)
    bounds = tile_frobenius_bound(tiles) + margin_log2
    N = len(lay.lengths)
    S0 = _initial_state(initial_state, N, H, K, Vd, q.device)
    final = S0.clone()
    o_tiles = torch.zeros_like(vt)
    ends, certified = {}, torch.zeros(len(rows), H, dtype=torch.bool)
    for r, row in enumerate(rows):
        n, own_first = row[SEG_SEQ], lay.tile_first[row[SEG_SEQ]]
        c0 = row[SEG_SEQ_OFFSET] // CHUNK
        assert row[SEG_FIRST_TOKEN] == int(lay.starts[n]) + row[SEG_SEQ_OFFSET]
        c1 = -(-(row[SEG_SEQ_OFFSET] + row[SEG_TOKENS]) // CHUNK)
        w = min(warmup_tiles, c0)
        for h in range(H):
            s = S0[n, h].clone() if w == c0 else torch.zeros_like(S0[n, h])
            for j in range(own_first + c0 - w, own_first + c1):
                if j == own_first + c0 and w < c0:
                    certified[r, h] = bool(bounds[j - w : j, h].sum() <= TRUNCATION_LOG2)
                    if not certified[r, h]:
                        s = ends[(row[SEG_PREDECESSOR], h)].clone()
                o_j, s = _tile_step(tiles, vt, j, h, s)
                if j >= own_first + c0:
                    o_tiles[j, h] = o_j
            ends[(r, h)] = s
            if row[SEG_FLAGS] & FLAG_FINAL_STATE:
                final[n, h] = s
    o = _untiled(o_tiles, lay, B * T)
    return o.view(B, T, H, Vd), final, certified


def kda_recurrent(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    gate_kind=DEFAULT_GATE,
    beta_sigmoid=True,
    qk_l2norm=True,
):
    """Token-by-token float64 recurrence -> ``(o [B, T, H, V], final_state [N, H, K, V])``.

    For each token: ``S ← diag(exp(γ))·S``; ``S ← S + b·k̂ (v − Sᵀk̂)ᵀ``; ``o = scale·Sᵀq̂``
    (output after the update). Independent of the tile machinery; kda_chunked must match it.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    lay = _layout(B, T, cu_seqlens, q.device)
    N = len(lay.lengths)

    def flat(x):
        return x.reshape(B * T, *x.shape[2:])

    alpha = torch.exp(flat(gate(g, A_log, dt_bias, lower_bound, gate_kind)))
    qn, kn, b = (flat(x) for x in conventions(q, k, beta, beta_sigmoid, qk_l2norm))
    vv = flat(v.to(torch.float64))

    S = _initial_state(initial_state, N, H, K, Vd, q.device)
    o = torch.zeros(B * T, H, Vd, dtype=torch.float64, device=q.device)
    for seqs, tok in _steps(lay.starts, lay.lengths, q.device):
        kt = kn[tok]
        s = alpha[tok][..., None] * S[seqs]
        err = vv[tok] - torch.einsum("nhkv,nhk->nhv", s, kt)
        s = s + b[tok][..., None, None] * kt[..., :, None] * err[..., None, :]
        o[tok] = scale * torch.einsum("nhkv,nhk->nhv", s, qn[tok])
        S[seqs] = s
    return o.view(B, T, H, Vd), S


def _short_conv(x, weight, bias, state):
    """Causal depthwise convolution of T new tokens, then SiLU -> ``(y [N, T, H, D], new state)``.

    x ``[N, T, H, D]`` (channel ``c = h·D + d``), weight ``[C, W]``, bias ``[C]`` or None, state
    ``[N, C, W−1]`` (the previous W−1 inputs, oldest first). On the window
    ``[state; x_0 .. x_{T−1}]``, token t sees ``window[t : t + W]``, so ``weight[:, W−1]`` takes the
    token itself (fla's ``causal_conv1d_update``, whose ``[N, C, W]`` cache is ``state`` with one
    dropped column in front). The new state is the window's last W−1 entries.
    """
    n, t = x.shape[:2]
    width = weight.shape[-1]
    window = torch.cat([state.to(torch.float64), x.reshape(n, t, -1).transpose(1, 2).to(torch.float64)], dim=-1)
    y = (window.unfold(-1, width, 1) * weight.to(torch.float64)[:, None, :]).sum(-1)  # [N, C, T]
    if bias is not None:
        y = y + bias.to(torch.float64)[:, None]
    y = torch.nn.functional.silu(y)
    return y.transpose(1, 2).reshape(x.shape), window[..., t:].contiguous()


def kda_decode_layer(
    q,
    k,
    v,
    g,
    beta,
    *,
    conv_weights,
    conv_states,
    initial_state,
    norm_weight,
    out_gate,
    A_log,
    dt_bias,
    lower_bound,
    conv_biases=None,
    gate_kind=DEFAULT_GATE,
    scale=None,
    eps=1e-5,
    round_o_kda=True,
):
    """One fused KDA decode-layer step of T tokens per request (the kernel's T = 1..8), in float64:
    ``-> (y [N, T, H, D], new_state [N, H, V, K], (new_sq, new_sk, new_sv))``.

    The part of fla's ``KimiDeltaAttention.forward`` between the projections and ``o_proj``, which
    the GPU kernel fuses: (1) pre-conv q, k, v ``[N, T, H, D]`` each through a width-W short
    convolution and SiLU (:func:`_short_conv`; ``conv_weights`` ``(wq, wk, wv)`` ``[H·D, W]``,
    ``conv_biases`` ``(bq, bk, bv)`` ``[H·D]`` each or all None, ``conv_states`` ``(sq, sk, sv)``
    ``[N, H·D, W−1]``); (2) the recurrence of :func:`kda_recurrent` with g ``[N, T, H, D]`` through
    ``gate_kind``, β ``[N, T, H]`` as logits, q/k L2-normalised, ``scale`` default D**-0.5, from
    ``initial_state`` S in the "vk" layout ``[N, H, V, K]``; (3) fla's sigmoid-gated RMSNorm
    (``FusedRMSNormGated``) over each head's D values,
    ``y = o · rsqrt(mean(o²) + eps) · norm_weight · σ(out_gate)``, norm_weight ``[D]``, out_gate
    ``[N, T, H, D]``.

    Roundings modelled: q̂/k̂ to bf16 (:func:`l2norm_bf16`, the contract's semantics) and, with
    ``round_o_kda``, o to bf16 before the norm (fla's recurrent kernel returns o in bf16). The conv
    outputs, S and y stay float64 (fla stores the conv outputs and y in bf16 and carries S in fp32);
    the new conv states are copies of inputs. T tokens in one call equal T calls of one token with
    both states carried, which speculative decoding relies on. The inputs are never modified.
    """
    biases = conv_biases or (None, None, None)
    (q, new_sq), (k, new_sk), (v, new_sv) = (
        _short_conv(x, w, b, s) for x, w, b, s in zip((q, k, v), conv_weights, biases, conv_states)
    )
    o, state = kda_recurrent(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        scale=scale,
        initial_state=initial_state.transpose(-1, -2),
        gate_kind=gate_kind,
    )
    if round_o_kda:
        o = _round(o, torch.bfloat16)
    y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps)
    y = y * norm_weight.to(torch.float64) * torch.sigmoid(out_gate.to(torch.float64))
    return y, state.transpose(-1, -2).contiguous(), (new_sq, new_sk, new_sv)


def rel_rmse(a, b) -> float:
    """``‖a − b‖ / ‖b‖`` over all elements in float64; inf if ``a`` has a NaN/Inf."""
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
