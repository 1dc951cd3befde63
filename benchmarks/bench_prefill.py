#!/usr/bin/env python3
"""Time the KDA prefill workloads of SPEC §7 on the GPU: serial (CP off) and intracard CP.

    python benchmarks/bench_prefill.py [--json PATH]

Each workload runs with initial and final state, CUDA events, 25 warm-up / 100 timed,
interquartile mean, for every K2 V-block the build compiled (the default is chosen from these
numbers), beside K1 alone, the published cuLA H200 figures, flash-linear-attention's
``chunk_kda`` when ``fla`` is importable (see ``benchmarks/peers.py``), and the bytes moved
against a copy bandwidth measured in the same run; then the CP workloads serial, with
s_split ∈ {2, 4, 8, 16} and with the planner's auto choice.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from benchmarks.peers import copy_bandwidth, fla_runner, prefill_bytes  # noqa: E402
from benchmarks.timing import time_cuda  # noqa: E402
from cula_aot.ops.prefill import prefill  # noqa: E402
from cula_aot.ops.prepare import prepare  # noqa: E402
from cula_aot.specs import K2_DEFAULT_V_BLOCK, K2_V_BLOCKS  # noqa: E402

# (label, heads, batch, lengths or None for fixed, T for fixed, published cuLA H200 ms)
WORKLOADS = [
    ("fixed 1x8192", 64, 1, None, 8192, 1.1928),
    ("varlen 6 seqs 8K", 64, 1, [1300, 547, 2048, 963, 271, 3063], None, 0.9287),
    ("uniform 8x1024", 64, 1, [1024] * 8, None, 0.6629),
    ("fixed 1x8192", 96, 1, None, 8192, 1.3495),
    ("varlen 6 seqs 8K", 96, 1, [1300, 547, 2048, 963, 271, 3063], None, 1.2497),
    ("uniform 8x1024", 96, 1, [1024] * 8, None, 0.9939),
]


def make_inputs(heads, batch, lengths, seq_len, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    total = sum(lengths) if lengths else seq_len
    shape = (batch, total, heads, 128)
    q, k, v, g = (torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(4))
    beta = torch.randn(batch, total, heads, generator=gen).to(torch.bfloat16).to(device)
    n = len(lengths) if lengths else batch
    cu = None
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, cu_cpu=None if cu is None else cu.cpu(),
                A_log=torch.log(torch.rand(heads, generator=gen) * 15 + 1).to(device),
                dt_bias=(0.1 * torch.randn(heads, 128, generator=gen)).to(device),
                s0=(0.1 * torch.randn(n, heads, 128, 128, generator=gen)).to(device))


# CP workloads of SPEC §7: (heads, lengths, published cuLA H200 ms with s_split 8)
CP_WORKLOADS = [
    (4, [8192], 0.3561), (4, [8192, 2048], 0.3638), (4, [16384], 0.6357),
    (8, [8192], 0.3768), (8, [8192, 2048], 0.3911), (8, [16384], 0.6759),
]
CP_SPLITS = (False, 2, 4, 8, 16, "auto")


def prefill_runner(x, **options):
    """A no-argument call of the full prefill (initial + final state) on inputs ``x``."""
    out = torch.empty_like(x["v"])
    final = torch.empty_like(x["s0"])

    def run():
        prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
                initial_state=x["s0"], cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"], out=out, final_state=final,
                **options)

    return run


def host_overhead_us(device, calls=2000) -> float:
    """Host time per call of a tiny prefill issued back to back (the GPU work is negligible)."""
    x = make_inputs(8, 1, None, 16, device)
    run = prefill_runner(x, intracard_cp=False)
    for _ in range(50):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def run_cp(device):
    rows = []
    for heads, lengths, published in CP_WORKLOADS:
        x = make_inputs(heads, 1, lengths, None, device)
        row = {"H": heads, "lengths": lengths, "published_cula_ms": published}
        for split in CP_SPLITS:
            row[f"cp_{split}"] = time_cuda(prefill_runner(x, intracard_cp=split))
        rows.append(row)
    print("| H | lengths | serial ms | " + " | ".join(f"s_split={s} ms" for s in CP_SPLITS[1:])
          + " | cuLA s_split 8 published ms |")
    print("|" + "---|" * (3 + len(CP_SPLITS)))
    for r in rows:
        cells = " | ".join(f"{r[f'cp_{s}']:.4f}" for s in CP_SPLITS)
        print(f"| {r['H']} | {r['lengths']} | {cells} | {r['published_cula_ms']:.4f} |")
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    rows = []
    for label, heads, batch, lengths, seq_len, published in WORKLOADS:
        x = make_inputs(heads, batch, lengths, seq_len, device)
        row = {"workload": label, "H": heads, "published_cula_ms": published}

        def k1(x=x):
            prepare(x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                    lower_bound=-5.0, cu_seqlens=x["cu"])

        row["k1_ms"] = time_cuda(k1)
        for vb in K2_V_BLOCKS:
            row[f"prefill_ms_vb{vb}"] = time_cuda(prefill_runner(x, intracard_cp=False, v_block=vb))
        row["best_ms"] = min(row[f"prefill_ms_vb{vb}"] for vb in K2_V_BLOCKS)
        row["GB"] = prefill_bytes(x) / 1e9
        fla = fla_runner(x)
        row["fla_ms"] = None if fla is None else time_cuda(fla)
        rows.append(row)
        del x
        torch.cuda.empty_cache()

    bandwidth = copy_bandwidth(device)
    header = "| H | workload | K1 ms | " + " | ".join(f"prefill vb={vb} ms" for vb in K2_V_BLOCKS)
    print(header + " | best ms | cuLA published ms | best / cuLA | fla chunk_kda ms | GB | % of copy BW |")
    print("|" + "---|" * (8 + len(K2_V_BLOCKS)))
    for r in rows:
        cells = " | ".join(f"{r[f'prefill_ms_vb{vb}']:.4f}" for vb in K2_V_BLOCKS)
        fla = "n/a" if r["fla_ms"] is None else f"{r['fla_ms']:.4f}"
        achieved = r["GB"] * 1e9 / (r["best_ms"] * 1e-3) / bandwidth
        print(f"| {r['H']} | {r['workload']} | {r['k1_ms']:.4f} | {cells} | {r['best_ms']:.4f} | "
              f"{r['published_cula_ms']:.4f} | {r['best_ms'] / r['published_cula_ms']:.2f}x | {fla} | "
              f"{r['GB']:.3f} | {100 * achieved:.1f}% |")
    print(f"(device copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s, read + write)")
    print(f"(runtime default v_block = {K2_DEFAULT_V_BLOCK})")
    overhead = host_overhead_us(device)
    print(f"host overhead per call (H=8, T=16, back to back, validation + 2 launches): {overhead:.1f} us")
    cp_rows = run_cp(device)
    if args.json:
        Path(args.json).write_text(json.dumps({"serial": rows, "cp": cp_rows, "copy_bandwidth_Bps": bandwidth,
                                               "host_overhead_us": overhead}, indent=1))


if __name__ == "__main__":
    main()
