"""A CPU model (float64) of the seed truncation in cuDNN's fused Hopper KDA prefill, and of our
tile certificate, on the rows and decay regimes of ``benchmarks/bench_cudnn.py``: how much work a
piece schedule saves or wastes under each rule.

    python -m benchmarks.truncation_model [--rows a,b] [--regimes standard,mixed,slow] [--probe] [--json PATH]

The rule, as nvidia-cudnn-frontend 1.32.0's ``kda_hopper_cuda`` engine runs it (restated, not
copied).  A launch cuts every (sequence, head) chain into P pieces, P = clamp(264 // (N·H), 1,
ceil(ceil(T/N)/16)): a fixed target of 264 CTAs (2 per SM on 132 SMs, not queried from the device),
the mean sequence length setting the cap for every sequence of a varlen batch.  A sequence of C
16-token chunks takes pieces of ceil(C/P) chunks (trailing empty pieces do nothing).  A piece that
starts at chunk c0 > 0 walks back over the whole chunks before it, summing per chunk the bound
max_d Σ_t γ[t, d]·log2(e) + 3.5 (the 3.5 = log2 √128 is added once per chunk: an allowance for the
delta rule mixing state entries), always at least one chunk, until the sum is ≤ -20; it then starts
from a zero state there and recomputes the warm-up chunks without writing o.  If the walk reaches
chunk 0 first, the piece starts from the sequence's initial state at chunk 0 (exact, but serial
again).  Only the last piece writes the final state.

The rigorous certificate of this model needs no allowance: with ‖k‖ ≤ 1 and β ∈ [0, 1] every
delta-rule factor (I − β k kᵀ) is non-expansive in the spectral norm, so the dropped state reaches
the end of a window attenuated by at most Π_t max_d α[t, d] (α = e^γ); per chunk that is
Σ_t max_d γ[t, d]·log2(e), walked back the same way to the same 2^-20.

Ours (``tile``, ``reference.tile_decay_bound``): per 16-token chunk (our tile) the smaller of two
sound bounds of the chunk map's spectral norm, the Frobenius norm of the map (diagonal plus rank 16,
formed from 16×16 Gram matrices) and the token-by-token product above (which it never exceeds, and
which also covers keys that are not normalised and b outside [0, 1]); walked back the same way.

A fourth certificate, the exact one (``exact_warmups``, on a probe row only: it walks 128×128
matrices back token by token): the Frobenius norm of the warm-up tokens' own transition product
M = A_last ⋯ A_first, A_t = (I − b_t k̂_t k̂_tᵀ)·diag(α_t) (``reference.kda_recurrent``'s order), a
sound upper bound of ‖M‖₂ that a kernel could track per chunk (a chunk's map is diagonal plus
rank 16), against the same 2^-20; and the true ‖M‖₂ where cuDNN's rule stops.

Per row and regime (all heads of the row; the inputs are ``draw_inputs(..., seed=0)``, the timed
rows' draw, and γ is ``cula_aot.gates.log_decay``): the certified fraction of the pieces that need a
certificate (c0 > 0), their mean / max warm-up in chunks, the redundant-work factor (chunks
processed, own + warm-up, ÷ the serial chunk count) and the critical-path ratio (longest piece with
its warm-up ÷ the longest chain).  Chunks are counted alike: a warm-up chunk skips the output, the
walk's extra g reads and the wave / occupancy effects are not modelled.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_cudnn import REGIMES, ROWS, draw_inputs
from benchmarks.bench_prefill import lengths_label
from cula_aot import reference
from cula_aot.gates import log_decay
from cula_aot.reference import conventions

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "docs" / "bench" / "truncation_model.json"

CHUNK = 16  # tokens per chunk, the unit of the pieces and of the walk
TARGET_CTAS = 264  # cuDNN's fixed CTA target (2 per SM × 132 SMs)
LOG_EPS = -20.0  # log2 of the attenuation a warm-up must prove
MIX_LOG2 = 3.5  # cuDNN's per-chunk allowance, log2 sqrt(128)
LOG2E = 1.0 / math.log(2.0)
RULES = ("cudnn", "rigorous", "tile")
HEAD_GROUP = 8  # heads per prepare_tiles call (bounds the float64 tile tensors of the long rows)
PROBE = (4, [8192])  # the exact certificate's row: H, lengths
PROBE_PIECE = 16  # its pieces: one per 16 chunks


# -- the schedule --------------------------------------------------------------------------------
def pieces_per_chain(total_tokens: int, n_seqs: int, heads: int) -> int:
    """cuDNN's P: fill ``TARGET_CTAS`` with N·H·P CTAs, never more pieces than the mean sequence's
    chunk count, at least one."""
    mean_chunks = math.ceil(math.ceil(total_tokens / n_seqs) / CHUNK)
    return max(1, min(TARGET_CTAS // max(n_seqs * heads, 1), mean_chunks))


def piece_ranges(chunks: int, p: int) -> list:
    """The non-empty ``(c0, c1)`` chunk ranges of a ``chunks``-chunk chain cut into ``p`` pieces of
    ceil(chunks / p) chunks (the last shorter; pieces that would start past the end are dropped)."""
    size = math.ceil(chunks / p) if chunks else 0
    return [(c0, min(c0 + size, chunks)) for c0 in range(0, chunks, size)] if size else []


def chunk_bounds(gamma: torch.Tensor, rule: str, tile: torch.Tensor | None = None) -> torch.Tensor:
    """Per full chunk and head, log2 of the attenuation bound of ``rule`` for one sequence's
    ``gamma`` [T, H, K] (float64 natural log-decay): ``[T // 16, H]``.  Only full chunks: the walk
    probes chunks before a piece's start, and only a sequence's last chunk can be partial.
    ``tile``: the sequence's ``reference.tile_decay_bound`` [chunks, H] (the "tile" rule's)."""
    full = gamma.shape[0] // CHUNK
    if rule == "tile":
        if tile is None:
            raise ValueError("the tile rule needs the sequence's tile_decay_bound (tile=)")
        return tile[:full]
    g = gamma[: full * CHUNK].reshape(full, CHUNK, *gamma.shape[1:])
    if rule == "cudnn":  # the least-decaying channel of the chunk sum, plus the mixing allowance
        return g.sum(1).amax(-1) * LOG2E + MIX_LOG2
    if rule == "rigorous":  # the least-decaying channel token by token: a spectral-norm bound
        return g.amax(-1).sum(1) * LOG2E
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def warmup(bounds: torch.Tensor, c0: int):
    """The walk of a piece starting at chunk ``c0`` ≥ 1 over ``bounds`` [chunks, H]: ``(w, certified)``
    per head, w the chunks walked back (c0 when it reaches the start), certified whether the summed
    bound got to ≤ 2^LOG_EPS within them (cuDNN stops on ``acc <= -20``)."""
    acc = bounds[:c0].flip(0).cumsum(0)  # acc[i]: bound over the i + 1 chunks before c0
    hit = acc <= LOG_EPS
    certified = hit.any(0)
    w = torch.where(certified, hit.to(torch.int64).argmax(0) + 1, torch.full_like(certified, c0, dtype=torch.int64))
    return w, certified


def model_chains(gammas: list, p: int, rule: str, tiles: list | None = None) -> dict:
    """``rule`` on the chains of one call: ``gammas`` one [T_s, H, K] log-decay per sequence, ``p``
    pieces per chain, ``tiles`` (the "tile" rule's) each sequence's ``tile_decay_bound`` [chunks, H].
    Totals over every (sequence, head) chain; warm-up statistics over the pieces that need a
    certificate (c0 > 0), None where there are none."""
    probed = certified = warm_sum = warm_max = work = serial = longest = serial_longest = 0
    for gamma, tile in zip(gammas, tiles or [None] * len(gammas)):
        chunks, heads = math.ceil(gamma.shape[0] / CHUNK), gamma.shape[1]
        bounds = chunk_bounds(gamma, rule, tile)
        serial += chunks * heads
        serial_longest = max(serial_longest, chunks)
        for c0, c1 in piece_ranges(chunks, p):
            w, ok = warmup(bounds, c0) if c0 else (torch.zeros(heads, dtype=torch.int64), None)
            if c0:
                probed += heads
                certified += int(ok.sum())
                warm_sum += int(w.sum())
                warm_max = max(warm_max, int(w.max()))
            work += heads * (c1 - c0) + int(w.sum())
            longest = max(longest, c1 - c0 + int(w.max()))
    return {
        "certified_fraction": certified / probed if probed else None,
        "warmup_mean": warm_sum / probed if probed else None,
        "warmup_max": warm_max if probed else None,
        "work_factor": work / serial if serial else None,
        "critical_path_ratio": longest / serial_longest if serial_longest else None,
    }


def exact_warmups(gamma: torch.Tensor, kn: torch.Tensor, b: torch.Tensor, starts: list, stop_at: torch.Tensor):
    """For pieces starting at the chunks ``starts`` (each c0 ≥ 1, every head; one sequence's
    float64 ``gamma`` and ``kn`` [T, H, K], ``b`` [T, H]): ``(w, certified, log2_spectral_at)``,
    each [len(starts), H].  w: the warm-up chunks after which the transition product M of the
    warm-up tokens has ‖M‖_F ≤ 2^LOG_EPS (c0 where it never does); ``log2_spectral_at``: log2 ‖M‖₂
    after ``stop_at`` [len(starts), H] chunks (another rule's warm-up; NaN past the start)."""
    heads, c0s = gamma.shape[1], torch.tensor(starts)
    n = len(starts) * heads
    first = c0s.repeat_interleave(heads) * CHUNK  # each walk's first token past its window
    head = torch.arange(heads).repeat(len(starts))
    stop = stop_at.reshape(-1)
    m = torch.eye(gamma.shape[-1], dtype=torch.float64).repeat(n, 1, 1)
    w, done = c0s.repeat_interleave(heads).clone(), torch.zeros(n, dtype=torch.bool)
    spectral = torch.full((n,), float("nan"), dtype=torch.float64)
    for j in range(1, int(c0s.max()) + 1):
        live = ((~done) | (stop >= j)) & (j <= first // CHUNK)
        if not live.any():
            break
        i = live.nonzero().squeeze(1)
        for t in range(CHUNK):  # M ← M·A_s for the chunk's tokens, last first
            tok = first[i] - (j - 1) * CHUNK - 1 - t
            k, h = kn[tok, head[i]], head[i]
            mk = torch.einsum("nij,nj->ni", m[i], k)
            m[i] = (m[i] - b[tok, h][:, None, None] * mk[:, :, None] * k[:, None, :]) * torch.exp(gamma[tok, h])[
                :, None, :
            ]
        log2_f = torch.linalg.matrix_norm(m[i]).log2()
        hit = (~done[i]) & (log2_f <= LOG_EPS)
        w[i[hit]], done[i[hit]] = j, True
        at = i[stop[i] == j]
        spectral[at] = torch.linalg.matrix_norm(m[at], ord=2).log2()
    shape = (len(starts), heads)
    return w.view(shape), done.view(shape), spectral.view(shape)


def model_probe(regime: str) -> dict:
    """The three certificates on ``PROBE``'s pieces (one per ``PROBE_PIECE`` chunks) in ``regime``."""
    heads, lengths = PROBE
    x = draw_inputs(heads, lengths, regime, "cpu", seed=0)
    gamma = log_decay(x["g"], x["A_log"], x["dt_bias"], x["lower_bound"])[0]
    _, kn, b = conventions(x["q"], x["k"], x["beta"])
    starts = list(range(PROBE_PIECE, math.ceil(lengths[0] / CHUNK), PROBE_PIECE))
    tile = row_tile_bounds(x)[0]
    bounds = {rule: chunk_bounds(gamma, rule, tile) for rule in RULES}
    walks = {rule: [warmup(bounds[rule], c0) for c0 in starts] for rule in RULES}
    w = {rule: torch.stack([v[0] for v in walks[rule]]) for rule in RULES}
    ok = {rule: torch.stack([v[1] for v in walks[rule]]) for rule in RULES}
    w["exact"], ok["exact"], spectral = exact_warmups(
        gamma, kn[0], b[0], starts, torch.where(ok["cudnn"], w["cudnn"], 0)
    )

    def summary(rule):
        done = w[rule][ok[rule]].double()
        stats = [None] * 3 if not done.numel() else [int(done.min()), float(done.median()), int(done.max())]
        return {"certified_fraction": float(ok[rule].double().mean()), "warmup_min_median_max": stats}

    cudnn_spectral = spectral[ok["cudnn"]]
    return {
        "workload": f"h{heads}-{lengths_label(lengths)}",
        "regime": regime,
        "pieces": len(starts) * heads,
        **{rule: summary(rule) for rule in (*RULES, "exact")},
        "cudnn_log2_spectral_worst": float(cudnn_spectral.max()) if cudnn_spectral.numel() else None,
        "cudnn_unsound_fraction": float((cudnn_spectral > LOG_EPS).double().mean()) if cudnn_spectral.numel() else None,
    }


# -- the rows ------------------------------------------------------------------------------------
def row_gammas(heads: int, lengths: list, regime: str) -> list:
    """bench_cudnn's inputs of a row in ``regime`` as per-sequence float64 γ [T_s, H, K]."""
    x = draw_inputs(heads, lengths, regime, "cpu", seed=0)
    gamma = log_decay(x["g"], x["A_log"], x["dt_bias"], x["lower_bound"])[0]
    return list(gamma.split(list(lengths)))


def row_tile_bounds(x: dict) -> list:
    """``reference.tile_decay_bound`` of a row's inputs, per sequence [chunks, H], a group of heads
    at a time."""
    heads = x["q"].shape[2]
    groups = []
    for h0 in range(0, heads, HEAD_GROUP):
        h = slice(h0, h0 + HEAD_GROUP)
        tiles = reference.prepare_tiles(
            *(x[n][:, :, h] for n in ("q", "k", "g", "beta")),
            A_log=x["A_log"][h],
            dt_bias=x["dt_bias"][h],
            lower_bound=x["lower_bound"],
            cu_seqlens=x["cu_cpu"],
        )
        groups.append(reference.tile_decay_bound(tiles))
    chunks = [math.ceil(n / CHUNK) for n in x["lengths"]]
    return list(torch.cat(groups, dim=1).split(chunks))


def model_row(name: str, regime: str) -> dict:
    heads, lengths = ROWS[name]
    gammas = row_gammas(heads, lengths, regime)
    tiles = row_tile_bounds(draw_inputs(heads, lengths, regime, "cpu", seed=0))
    p = pieces_per_chain(sum(lengths), len(lengths), heads)
    chunks = [math.ceil(n / CHUNK) for n in lengths]
    out = {
        "workload": name,
        "regime": regime,
        "H": heads,
        "N": len(lengths),
        "T": sum(lengths),
        "lengths": list(lengths),
        "pieces_per_chain": p,
        "pieces": heads * sum(len(piece_ranges(c, p)) for c in chunks),
        "serial_chunks": heads * sum(chunks),
        "ideal_critical_path_ratio": max(c1 - c0 for c in chunks for c0, c1 in piece_ranges(c, p)) / max(chunks),
    }
    for rule in RULES:
        out[rule] = model_chains(gammas, p, rule, tiles)
    return out


# -- output --------------------------------------------------------------------------------------
def _f(value, spec):
    return "–" if value is None else format(value, spec)


def render_markdown(res: dict) -> str:
    command = f"`{res['meta']['command']}` (float64, all heads, `draw_inputs(seed=0)`; rules: `benchmarks/truncation_model.py`)."
    legend = (
        "P: pieces per chain (cuDNN's choice). Per rule: cert = certified fraction of the pieces that need a "
        "certificate (c0 > 0); warm-up = mean / max chunks walked back (to the start when uncertified); "
        "work = chunks processed (own + warm-up) ÷ serial chunks; crit = longest piece with warm-up ÷ longest "
        "chain (ideal: no warm-up at all). cuDNN: max_d Σ_chunk γ·log2 e + 3.5 per chunk ≤ -20; rigorous: "
        "Σ_t max_d γ·log2 e ≤ -20; tile: reference.tile_decay_bound (min of the chunk map's Frobenius norm and "
        "the token-by-token bound) ≤ -20."
    )
    out = ["# cuDNN's seed truncation, modelled on the CPU", "", command, "", legend, ""]
    header = ["row", "H", "N", "T", "P", "pieces", "crit ideal"]
    for rule in RULES:
        header += [f"{rule} cert", f"{rule} warm-up", f"{rule} work", f"{rule} crit"]
    for regime in REGIMES:
        rows = [r for r in res["rows"] if r["regime"] == regime]
        if not rows:
            continue
        out += [f"## {regime}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for r in rows:
            cells = [r["workload"], r["H"], r["N"], r["T"], r["pieces_per_chain"], r["pieces"]]
            cells.append(_f(r["ideal_critical_path_ratio"], ".3f"))
            for rule in RULES:
                m = r[rule]
                cells += [
                    _f(m["certified_fraction"], ".3f"),
                    f"{_f(m['warmup_mean'], '.1f')} / {_f(m['warmup_max'], 'd')}",
                    _f(m["work_factor"], ".2f"),
                    _f(m["critical_path_ratio"], ".3f"),
                ]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("")
    if res.get("probe"):
        out += [
            f"## The exact certificate on h{PROBE[0]}-{lengths_label(PROBE[1])} (a piece per {PROBE_PIECE} chunks)",
            "",
            "cert / warm-up chunks min, median, max of the certified pieces; exact: ‖M‖_F ≤ 2^-20 of the warm-up's "
            "transition product; last two columns: ‖M‖₂ where cuDNN's rule stops.",
            "",
            "| regime | pieces | cuDNN | rigorous | tile | exact | cuDNN worst log2 ‖M‖₂ | cuDNN stops above 2^-20 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in res["probe"]:
            cells = [r["regime"], r["pieces"]]
            for rule in (*RULES, "exact"):
                lo, mid, hi = r[rule]["warmup_min_median_max"]
                cells.append(f"{r[rule]['certified_fraction']:.3f} / {_f(lo, 'd')}, {_f(mid, '.0f')}, {_f(hi, 'd')}")
            cells += [_f(r["cudnn_log2_spectral_worst"], ".1f"), _f(r["cudnn_unsound_fraction"], ".3f")]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="all", help=f"comma list or 'all': {', '.join(ROWS)}")
    p.add_argument("--regimes", default="all", help=f"comma list or 'all': {', '.join(REGIMES)}")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="results file")
    p.add_argument("--probe", action="store_true", help="also the exact certificate on PROBE's pieces (minutes)")
    args = p.parse_args(argv)
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    regimes = list(REGIMES) if args.regimes == "all" else args.regimes.split(",")
    command = "python -m benchmarks.truncation_model" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    meta = {"command": command, "chunk": CHUNK, "target_ctas": TARGET_CTAS, "log_eps": LOG_EPS, "mix_log2": MIX_LOG2}
    res = {"meta": meta, "rows": []}
    for regime in regimes:
        for name in rows:
            start = time.time()
            res["rows"].append(model_row(name, regime))
            r = res["rows"][-1]
            print(
                f"{regime:8s} {name:12s} {lengths_label(ROWS[name][1]):10s} P={r['pieces_per_chain']:3d}  "
                + "  ".join(
                    f"{rule}: cert {_f(r[rule]['certified_fraction'], '.3f')} work {r[rule]['work_factor']:.2f} "
                    f"crit {r[rule]['critical_path_ratio']:.3f}"
                    for rule in RULES
                )
                + f"  ({time.time() - start:.1f} s)",
                flush=True,
            )
    if args.probe:
        res["probe"] = []
        for regime in regimes:
            start = time.time()
            res["probe"].append(model_probe(regime))
            print(f"probe {regime}: {time.time() - start:.0f} s", flush=True)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(render_markdown(res))


if __name__ == "__main__":
    main()
