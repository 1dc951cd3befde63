"""The chunk decode kernel's fragment maps and algebra, emulated on the CPU in float64.

``kernels/decode_chunk.py`` computes T decode tokens as P = S_0·[kd | qd] (tensor cores), a
per-head T×T solve folded into a matrix G, and a rank-T update, with every lane's registers
addressed through plain integer maps.  Here one warp's registers are filled exactly as those
maps say, each ``mma.sync`` is emulated from the PTX ISA's fragment definitions, the shared-
memory operand arrays are laid out by the kernel's own chunk maps, and the result must equal
the token recurrence (CONTRACT §10) to float64 rounding: a wrong map, index or formula shows up as
an O(1) error.  Quarter-warp bank-conflict freedom of the operand reads is checked as well.
Needs CuTeDSL (the kernel module imports it).
"""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import decode_chunk as dc  # noqa: E402
from cula_aot.kernels.gate import UNBOUNDED_GAMMA_FLOOR  # noqa: E402

D = 128
LANES = 32
TOKENS = dc.TOKENS


def _lane(lane):
    return lane // 4, lane % 4


def _mma(shape, a, b):
    """D = A·B of one mma.sync from every lane's A and B fragment values (PTX ISA layouts);
    returns d[lane] = [(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)]."""
    kdim = {"k16": 16, "k8": 8, "k4": 4}[shape]
    A = np.full((16, kdim), np.nan)
    B = np.full((kdim, 8), np.nan)
    for lane in range(LANES):
        g, c = _lane(lane)
        if shape == "k16":  # a: 4 pairs, b: 2 pairs
            for i, (r, k0) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
                A[r, k0 : k0 + 2] = a[lane][i]
            B[2 * c : 2 * c + 2, g] = b[lane][0]
            B[2 * c + 8 : 2 * c + 10, g] = b[lane][1]
        elif shape == "k8":
            for i, (r, k) in enumerate(((g, c), (g + 8, c), (g, c + 4), (g + 8, c + 4))):
                A[r, k] = a[lane][i]
            B[c, g], B[c + 4, g] = b[lane]
        else:
            A[g, c], A[g + 8, c] = a[lane]
            B[c, g] = b[lane][0]
    assert not np.isnan(A).any() and not np.isnan(B).any(), "a fragment element was never set"
    out = A @ B
    return [
        [out[g, 2 * c], out[g, 2 * c + 1], out[g + 8, 2 * c], out[g + 8, 2 * c + 1]]
        for g, c in map(_lane, range(LANES))
    ]


def _add(x, y):
    return [[p + q for p, q in zip(a, b)] for a, b in zip(x, y)]


def _problem(tokens, seed):
    """One head's prologue outputs in float64 (natural key order) and a 16-row state block."""
    rng = np.random.default_rng(seed)
    khat = rng.standard_normal((tokens, D))
    khat /= np.linalg.norm(khat, axis=1, keepdims=True)
    qhat = rng.standard_normal((tokens, D))
    qhat /= np.linalg.norm(qhat, axis=1, keepdims=True)
    alpha = np.exp(-rng.uniform(0.0, 0.5, (tokens, D)))
    decay = np.cumprod(alpha, axis=0)  # A_t
    return dict(
        khat=khat,
        qhat=qhat,
        alpha=alpha,
        decay=decay,
        b=rng.uniform(0.1, 0.9, tokens),
        v=rng.standard_normal((tokens, 16)),
        s0=0.1 * rng.standard_normal((16, D)),
        scale=D**-0.5,
    )


def _recurrence(x, tokens):
    """CONTRACT §10 token by token: S ← S·diag(α); u = b(v − S k̂); o = scale·S_new q̂."""
    s = x["s0"].copy()
    outs = []
    for t in range(tokens):
        s = s * x["alpha"][t]
        u = x["b"][t] * (x["v"][t] - s @ x["khat"][t])
        s = s + np.outer(u, x["khat"][t])
        outs.append(x["scale"] * s @ x["qhat"][t])
    return np.array(outs), s


def _padded(x, name, tokens):
    """Token arrays padded to TOKENS with NaN: the kernel never reads past T unselected."""
    a = x[name]
    return np.concatenate([a, np.full((TOKENS - tokens,) + a.shape[1:], np.nan)]) if tokens < TOKENS else a


def _range_decay(x, first, last):
    """Π α_r over tokens first < r ≤ last, per key (the unbounded form's factors)."""
    return np.prod(x["alpha"][first + 1 : last + 1], axis=0) if last > first else np.ones(D)


def _emulate(x, tokens, deferred=True):
    """One warp of the chunk kernel, map by map; returns (o [T, 16], new state [16, 128]).
    ``deferred``: the safe gate's products through ki = k̂/A_t; else the unbounded gates', each
    from its factors (``decode_chunk._reduce_dots``, ``_build_update_operands``)."""
    kd = _padded(x, "khat", tokens) * _padded(x, "decay", tokens)
    qd = _padded(x, "qhat", tokens) * _padded(x, "decay", tokens)
    ki = _padded(x, "khat", tokens) / _padded(x, "decay", tokens)
    live = np.arange(TOKENS) < tokens
    kdqd = np.stack([np.where(live[:, None], kd, 0.0), np.where(live[:, None], qd, 0.0)])  # the builders' selects
    # P operands, laid out by the builder's chunk map; lane (g, c) reads chunk (m, g, c).
    pb = np.full(dc.P_COLUMNS * D, np.nan)
    for i in range(4 * dc.P_COLUMNS * 4):
        m, n, c = dc.pb_work(i)
        kind, t = dc.p_column(n)
        chunk = dc.pb_chunk(m, n, c)
        pb[8 * chunk : 8 * chunk + 8] = kdqd[kind, t, 32 * m + 8 * c : 32 * m + 8 * c + 8]
    state = {}
    for lane in range(LANES):
        g, c = _lane(lane)
        for r in range(2):
            for p in range(dc.PAIRS):
                state[lane, r, p] = tuple(x["s0"][g + 8 * r, dc.key_of(c, p, e)] for e in range(2))
    acc = None
    for m in range(4):
        for half in range(2):
            p = 4 * m + 2 * half
            a = [
                [state[lane, 0, p], state[lane, 1, p], state[lane, 0, p + 1], state[lane, 1, p + 1]]
                for lane in range(LANES)
            ]
            b = []
            for lane in range(LANES):
                g, c = _lane(lane)
                words = pb[8 * dc.pb_chunk(m, g, c) : 8 * dc.pb_chunk(m, g, c) + 8].reshape(4, 2)
                b.append([tuple(words[2 * half]), tuple(words[2 * half + 1])])
            d = _mma("k16", a, b)
            acc = d if acc is None else _add(acc, d)
    # G from the per-head dots, by forward substitution (the kernel's _solve_g).
    if deferred:
        dots = {(kind, t, s): ki[s] @ (kd if kind == 0 else qd)[t] for kind, t, s in dc.DOTS}
    else:
        raw = {0: _padded(x, "khat", tokens), 1: _padded(x, "qhat", tokens)}
        dots = {
            (kind, t, s): (raw[0][s] * raw[kind][t] * _range_decay(x, s, t)) @ np.ones(D) if t < tokens else np.nan
            for kind, t, s in dc.DOTS
        }
    g_arr = np.full(64 + 8 * TOKENS, np.nan)
    for i in range(TOKENS):
        w = []
        for t in range(TOKENS):
            acc_w = float(i == t) - sum(dots[(0, t, s)] * w[s] for s in range(t)) if live[t] else 0.0
            w.append(x["b"][t] * acc_w if live[t] else 0.0)
        for t in range(TOKENS):
            z = (x["khat"][t] @ x["qhat"][t]) * w[t] if live[t] else 0.0
            z += sum(dots[(1, t, s)] * w[s] for s in range(t)) if live[t] else 0.0
            g_arr[dc.g1_index(i, 2 * t)] = -w[t]
            g_arr[dc.g1_index(i, 2 * t + 1)] = -x["scale"] * z
            g_arr[dc.g1_index(i + TOKENS, 2 * t)] = 0.0
            g_arr[dc.g1_index(i + TOKENS, 2 * t + 1)] = x["scale"] * (i == t)
            g_arr[dc.g2_index(i, 2 * t)] = w[t]
            g_arr[dc.g2_index(i, 2 * t + 1)] = x["scale"] * z
    a1 = [[d[0], d[2], d[1], d[3]] for d in acc]  # (P_kd,c, P_qd,c) of rows g, g + 8
    b1 = [[g_arr[dc.g1_index(c, g)], g_arr[dc.g1_index(c + TOKENS, g)]] for g, c in map(_lane, range(LANES))]
    v = [
        [x["v"][c, g] if c < tokens else 0.0, x["v"][c, g + 8] if c < tokens else 0.0]
        for g, c in map(_lane, range(LANES))
    ]
    b2 = [[g_arr[dc.g2_index(c, g)]] for g, c in map(_lane, range(LANES))]
    uo = _add(_mma("k8", a1, b1), _mma("k4", v, b2))
    o = np.full((TOKENS, 16), np.nan)
    for lane, (u_g, o_g, u_g8, o_g8) in enumerate(uo):
        g, c = _lane(lane)
        o[c, g], o[c, g + 8] = o_g, o_g8
    # K̃ laid out by the builder's chunk map; lane (g, c) reads kt_index(c, g % 2, g // 2, 4m) + jj.
    last = tokens - 1
    kt = np.full(TOKENS * D, np.nan)
    for i in range(dc.KT_WORK):
        t, m, c_key = dc.kt_work(i)
        for e in range(2):  # the builder's vector of keys 32m + 8·c_key .. + 7, split by parity
            for jj in range(4):
                key = 32 * m + 8 * c_key + 2 * jj + e
                assert key == dc.key_of(c_key, 4 * m + jj, e)
                later = (
                    ki[t, key] * x["decay"][last, key]
                    if deferred
                    else (x["khat"][t, key] * _range_decay(x, t, last)[key] if live[t] else np.nan)
                )
                kt[dc.kt_index(t, e, c_key, 4 * m) + jj] = later if live[t] else 0.0
    new = np.full((16, D), np.nan)
    for j in range(dc.PAIRS):
        m, jj = divmod(j, 4)
        a_u = [[uo[lane][0], uo[lane][2], 0.0, 0.0] for lane in range(LANES)]  # u split as hi + 0
        b_u = []
        c_frag = []
        for lane in range(LANES):
            g, c = _lane(lane)
            kb = kt[dc.kt_index(c, g % 2, g // 2, 4 * m) + jj]
            b_u.append([kb, kb])
            keys = [dc.key_of(c, j, e) for e in range(2)]
            c_frag.append(
                [state[lane, 0, j][e] * x["decay"][last, keys[e]] for e in range(2)]
                + [state[lane, 1, j][e] * x["decay"][last, keys[e]] for e in range(2)]
            )
        d = _add(_mma("k8", a_u, b_u), c_frag)
        for lane in range(LANES):
            g, c = _lane(lane)
            for e in range(2):
                new[g, dc.key_of(c, j, e)] = d[lane][e]
                new[g + 8, dc.key_of(c, j, e)] = d[lane][2 + e]
    return o[:tokens], new


@pytest.mark.parametrize("tokens", [2, 3, 4])
def test_emulated_warp_equals_the_token_recurrence(tokens):
    for seed in range(3):
        x = _problem(tokens, seed)
        want_o, want_s = _recurrence(x, tokens)
        got_o, got_s = _emulate(x, tokens)
        assert np.isfinite(got_s).all() and np.isfinite(got_o).all()
        np.testing.assert_allclose(got_o, want_o, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got_s, want_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tokens", [2, 3, 4])
def test_unbounded_form_at_the_gate_floor(tokens):
    """Under the unbounded gates a key may decay by the gate's floor, 2^-14, on every token (A_t
    down to 2^-56 over 4 tokens): the factored form still equals the recurrence."""
    for seed in range(3):
        x = _problem(tokens, seed)
        rng = np.random.default_rng(100 + seed)
        fast = rng.random((tokens, D)) < 0.4
        x["alpha"] = np.where(fast, 2.0**UNBOUNDED_GAMMA_FLOOR, x["alpha"])
        x["decay"] = np.cumprod(x["alpha"], axis=0)
        want_o, want_s = _recurrence(x, tokens)
        got_o, got_s = _emulate(x, tokens, deferred=False)
        assert np.isfinite(got_s).all() and np.isfinite(got_o).all()
        np.testing.assert_allclose(got_o, want_o, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got_s, want_s, rtol=0, atol=1e-12)
        x_mild = _problem(tokens, seed)  # and on ordinary decays it is the deferred form's result
        np.testing.assert_allclose(
            _emulate(x_mild, tokens, deferred=False)[1], _emulate(x_mild, tokens)[1], rtol=0, atol=1e-12
        )


def test_key_map_covers_every_key_once_per_row():
    keys = sorted(dc.key_of(c, p, e) for c in range(4) for p in range(dc.PAIRS) for e in range(2))
    assert keys == list(range(D))
    for c in range(4):  # each 16-byte vector of a lane is 8 consecutive keys
        for m in range(4):
            assert [dc.key_of(c, 4 * m + w, e) for w in range(4) for e in range(2)] == list(
                range(32 * m + 8 * c, 32 * m + 8 * c + 8)
            )
            for r in range(2):  # the kernel's load / store / stage address of that vector
                assert 2 * dc._state_word(5, r, m, c) == (5 + 8 * r) * D + 32 * m + 8 * c


def test_every_built_cta_has_at_most_128_threads():
    """The per-key prologue passes hand each of a CTA's threads at least one of 128 work items."""
    from cula_aot.specs import DECODE_CHUNK_VARIANTS

    assert all(dc.threads(warps) <= D for warps, _ in DECODE_CHUNK_VARIANTS)


def test_work_maps_cover_every_chunk_once():
    pb = sorted(dc.pb_chunk(*dc.pb_work(i)) for i in range(4 * dc.P_COLUMNS * 4))
    assert pb == list(range(4 * dc.P_COLUMNS * 4))
    kt = sorted(
        dc.kt_index(t, e, c_key, 4 * m) + jj
        for t, m, c_key in map(dc.kt_work, range(dc.KT_WORK))
        for e in range(2)
        for jj in range(4)
    )
    assert kt == list(range(TOKENS * D))


def _bank_groups(byte_addresses):
    """16-byte bank groups of one quarter warp's vector reads (distinct addresses only)."""
    return [a // 16 % 8 for a in sorted(set(byte_addresses))]


def test_operand_reads_are_conflict_free():
    for quarter in range(4):
        lanes = range(8 * quarter, 8 * quarter + 8)
        for m in range(4):
            pb = [16 * dc.pb_chunk(m, g, c) for g, c in map(_lane, lanes)]
            kt = [4 * dc.kt_index(c, g % 2, g // 2, 4 * m) for g, c in map(_lane, lanes)]
            decay = [[4 * (32 * m + 8 * c) + 16 * half for g, c in map(_lane, lanes)] for half in range(2)]
            for addresses in (pb, kt, *decay):
                groups = _bank_groups(addresses)
                assert len(groups) == len(set(groups)), (quarter, m, addresses)
