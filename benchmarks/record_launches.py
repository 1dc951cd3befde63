"""Every kernel launch a fixed set of prefill and decode calls makes, recorded on the CPU with the
driver stubbed: kernel, grid, shared memory, dependent flag and each parameter's value (pointers
and TMA bases named by the tensor they point into).  Two trees whose records are equal feed the
GPU the same launches, so a host-side refactor can be checked without a GPU:

    git worktree add /tmp/base REV && (cd /tmp/base && python build_kernels.py)
    python benchmarks/record_launches.py /tmp/base /tmp/base.json
    python benchmarks/record_launches.py . /tmp/head.json && cmp /tmp/base.json /tmp/head.json

``--host-us`` times the Python part of eager calls instead (launches stubbed, median of 15
bursts of 500): a cached pool prefill (H12 1×2048), decode steps (N32 H12, T1 on an fp32 pool
and T4 on a bf16 one) and fused layer steps (N32 H12, T1, and T4 verifying a draft; through
``kda_decode_layer`` and through a ``DecodeLayerStep``), e.g. a tree beside its base on one machine.

(A tree older than the current manifest schema needs its own build, or CULA_AOT_ARTIFACTS.)  The
module names patched below include those of earlier trees, so a refactor compares with its base.
"""

import importlib
import json
import statistics
import struct
import sys
import time

import torch

tree = sys.argv[1]
HOST_US = sys.argv[2] == "--host-us"
sys.path.insert(0, tree)
import cula_aot  # noqa: E402  (from ``tree``)
from cula_aot.runtime import tma  # noqa: E402
from cula_aot.runtime.loader import LoadedKernel  # noqa: E402
from cula_aot.runtime.manifest import Manifest  # noqa: E402
from cula_aot.testing import cu_seqlens_of, standard_inputs  # noqa: E402

man = Manifest.discover()
LAUNCHES = []
TENSORS = {}


def label(v):
    for name, t in TENSORS.items():
        if t is None:
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if lo <= v < max(hi, lo + 1):
            return f"{name}+{v - lo}"
    return "other"


class FakeLoader:
    def get(self, device, spec):
        name, record = man.record(spec)
        kern = LoadedKernel(name, record, function=None)

        def launch_packed(packed, grid, stream, smem_bytes=None, dependent=False, kern=kern):
            if HOST_US:
                return
            vals = dict(zip(kern.packer.names, kern.packer.struct.unpack(packed)))
            out = {}
            for p in record["params"]:
                v = vals.get(p["name"])
                if p["kind"] == "pointer":
                    out[p["name"]] = 0 if v == 0 else label(v)
                elif p["kind"] == "tma_descriptor":
                    base, *rest = struct.unpack("<QQQQQQ", v[:48])
                    out[p["name"]] = [label(base), *rest]
                else:
                    out[p["name"]] = v
            LAUNCHES.append(
                {"kernel": name, "grid": list(grid), "smem": smem_bytes, "dependent": dependent, "values": out}
            )

        kern.launch_packed = launch_packed
        return kern


fake = FakeLoader()
tma._encode = lambda recipe, base, dims, strides, what: struct.pack("<QQQQQQ", base, *dims, *strides).ljust(128, b"\0")
for m in [
    "cula_aot.ops.prefill",
    "cula_aot.ops.decode",
    "cula_aot.ops.decode_layer",
    "cula_aot.ops.prefill_checks",
    "cula_aot.ops.checks",
    "cula_aot.ops.prefill_plans",
    "cula_aot.ops.prepare",
    "cula_aot.ops.paths",
    "cula_aot.ops.plan_cache",
]:
    try:
        mod = importlib.import_module(m)
    except ImportError:
        continue
    if hasattr(mod, "default_loader"):
        mod.default_loader = lambda: fake
    for n in ("_check_device", "check_device"):
        if hasattr(mod, n):
            setattr(mod, n, lambda device: None)
    for n in ("_raw_stream", "raw_stream"):
        if hasattr(mod, n):
            setattr(mod, n, lambda device: 0)
    for n in ("_sm_count", "sm_count"):
        if hasattr(mod, n):
            setattr(mod, n, lambda device: 132)
    if m.endswith("decode"):
        _fail = mod.fail

        def lenient(message, _fail=_fail):
            if not message.startswith("inputs are on"):
                _fail(message)

        mod.fail = lenient
import cula_aot.ops.prefill_plans as pp  # noqa: E402

# One stream object for every call: building a class per call would add ~5 µs to --host-us.
_STREAM = type("S", (), {"cuda_stream": 0})()
torch.cuda.current_stream = lambda device=None: _STREAM


class Tables:
    def get(self, key, make, device, stream):
        vals = make()
        t = torch.tensor(vals, dtype=torch.int32)
        TENSORS["table"] = t
        return t


pp.SEGMENT_TABLES = Tables()
if hasattr(pp, "_zero_words"):

    def zero_words(address, count, stream):
        if not HOST_US:
            LAUNCHES.append({"memset": label(address), "words": count})

    pp._zero_words = zero_words
from cula_aot.ops import workspace  # noqa: E402


class Arena:
    def buffer(self, device, nbytes, stream):
        t = TENSORS.get("workspace")
        if t is None or t.numel() < nbytes:
            t = torch.zeros(nbytes, dtype=torch.uint8)
            TENSORS["workspace"] = t
        return t

    def carve(self, device, slots, stream):
        return {}

    def pointers(self, device, slots, stream):
        return (self.buffer(device, max(slots, 1) * 64, stream).data_ptr(),)


workspace.ARENA = Arena()
pp.ARENA = workspace.ARENA

results = {}


def case(name, fn):
    """Record ``fn``'s launches on its first call and on a repeat (a cached plan's)."""
    LAUNCHES.clear()
    try:
        fn()
        fn()
        results[name] = list(LAUNCHES)
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"


def prefill_case(
    B,
    T,
    H,
    lengths=None,
    gate="safe",
    layout="vk",
    pool_dtype=None,
    ckpt=False,
    status=False,
    conv=False,
    cp=False,
    fwd=False,
    fused_heads=False,
    fused=None,
    seed=0,
):
    x = standard_inputs(B, T, H, seed=seed, gate=gate)
    q, k, v, g, beta = (x.pop(n) for n in ("q", "k", "v", "g", "beta"))
    TENSORS.clear()
    TENSORS.update(q=q, k=k, v=v, g=g, beta=beta, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
    kw = dict(x)
    n = B if lengths is None else len(lengths)
    if lengths is not None:
        cu = cu_seqlens_of(lengths)
        kw["cu_seqlens"] = cu
        TENSORS["cu"] = cu
        if cp:
            kw["cu_seqlens_cpu"] = cu.clone()
    out = torch.empty_like(v)
    TENSORS["out"] = out
    kw["out"] = out
    if pool_dtype is not None:
        pool = torch.zeros(n + 3, H, 128, 128, dtype=pool_dtype)
        TENSORS["pool"] = pool
        idx = torch.tensor([(i * 2 + 1) % (n + 3) for i in range(n)], dtype=torch.int32)
        TENSORS["idx"] = idx
        kw.update(initial_state=pool, final_state=pool, state_indices=idx)
    else:
        init = torch.randn(n, H, 128, 128)
        fin = torch.zeros(n, H, 128, 128)
        TENSORS.update(init=init, fin=fin)
        kw.update(initial_state=init, final_state=fin)
    if ckpt:
        cpool = torch.zeros(8, H, 128, 128)
        cidx = torch.zeros(n, 3, dtype=torch.int32)
        TENSORS.update(cpool=cpool, cidx=cidx)
        kw.update(checkpoint_every=32, checkpoint_pool=cpool, checkpoint_indices=cidx)
    if status:
        st = torch.zeros(4, dtype=torch.int32)[:1]
        TENSORS["status"] = st
        kw["status"] = st
    if conv:
        kw.update(beta_sigmoid=False, qk_l2norm=False)
    if not fwd:
        kw["state_layout"] = layout
        kw["intracard_cp"] = (2 if cp is True else cp) if cp else False  # cp: True (s = 2) or "truncated"
        if fused is not None:  # a path override: the internal entry's
            from cula_aot.ops.prefill import prefill

            return lambda: prefill(q, k, v, g, beta, fused=fused, **kw)
        return lambda: cula_aot.kda_prefill(q, k, v, g, beta, **kw)
    names = ("scale", "out", "A_log", "dt_bias", "lower_bound", "initial_state", "final_state", "cu_seqlens")
    positional = [kw.pop(name, None) for name in names]
    return lambda: cula_aot.fwd(q, k, v, g, beta, *positional, **kw)


def decode_case(N, T, H, gate="safe", bf16=False, layout="vk", inter=False, flat=False, status=False):
    x = standard_inputs(N, T, H, seed=1, gate=gate)
    q, k, v, g, beta = (x.pop(n) for n in ("q", "k", "v", "g", "beta"))
    TENSORS.clear()
    TENSORS.update(q=q, k=k, v=v, g=g, beta=beta, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    pool = torch.zeros(N + 2, H, 128, 128, dtype=dtype)
    idx = torch.tensor([(i + 1) % (N + 2) for i in range(N)], dtype=torch.int32)
    out = torch.empty_like(v)
    TENSORS.update(pool=pool, idx=idx, out=out)
    kw = dict(x, state_pool=pool, state_indices=idx, out=out, state_layout=layout)
    if inter:
        it = torch.zeros(N, T, H, 128, 128, dtype=dtype)
        TENSORS["inter"] = it
        kw["intermediate_states"] = it
    if status:
        st = torch.zeros(4, dtype=torch.int32)[:1]
        TENSORS["status"] = st
        kw["status"] = st
    if flat:
        q, k, v, g, beta = (t.flatten(0, 1) for t in (q, k, v, g, beta))
        kw["out"] = out.flatten(0, 1)
        kw["num_tokens"] = T
    return lambda: cula_aot.kda_decode(q, k, v, g, beta, **kw)


def layer_case(N, T, H, bf16=False, speculative=False, verify=False, step=False):
    """The fused decode layer on packed conv weights and a dim-major conv-state pool."""
    x = standard_inputs(N, T, H, seed=3)
    q, k, v, g, beta = (x.pop(n) for n in ("q", "k", "v", "g", "beta"))
    C = H * 128
    pool = torch.zeros(N + 2, H, 128, 128, dtype=torch.bfloat16 if bf16 else torch.float32)
    conv_state = torch.zeros(N + 2, 3 * C, 3, dtype=torch.bfloat16)
    weight = torch.zeros(3 * C, 4, dtype=torch.bfloat16)
    z = torch.zeros_like(v)
    norm = torch.ones(128, dtype=torch.bfloat16)
    idx = torch.tensor([(i + 1) % (N + 2) for i in range(N)], dtype=torch.int32)
    out = torch.empty_like(v)
    TENSORS.clear()
    TENSORS.update(q=q, k=k, v=v, g=g, beta=beta, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
    TENSORS.update(pool=pool, idx=idx, out=out, conv_state=conv_state, weight=weight, z=z, norm=norm)
    kw = dict(x, state_pool=pool, state_indices=idx, out=out, conv_weight=weight, conv_state=conv_state)
    kw.update(out_gate=z, norm_weight=norm)
    if speculative:
        drafts = cula_aot.draft_buffers(N + 2, H)
        accepted = torch.zeros(N, dtype=torch.int32)
        TENSORS.update(records=drafts.records, marks=drafts.marks, accepted=accepted)
        kw.update(drafts=drafts, num_accepted=accepted, verify=verify)
    if step:  # the fixed tensors bound once (DecodeLayerStep)
        per_call = {
            name: kw.pop(name) for name in ("out_gate", "state_indices", "out", "num_accepted", "verify") if name in kw
        }
        layer = cula_aot.DecodeLayerStep(**kw)
        z_, idx_ = per_call.pop("out_gate"), per_call.pop("state_indices")
        return lambda: layer(q, k, v, g, beta, z_, idx_, **per_call)
    return lambda: cula_aot.kda_decode_layer(q, k, v, g, beta, **kw)


def k1_case(lengths, gate, conventions):
    x = standard_inputs(1, sum(lengths), 4, seed=2, gate=gate)
    q, k, g, beta = (x.pop(n) for n in ("q", "k", "g", "beta"))
    x.pop("v")
    TENSORS.clear()
    TENSORS.update(q=q, k=k, g=g, beta=beta, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"))
    from cula_aot.ops.prepare import prepare

    cu = cu_seqlens_of(lengths)
    TENSORS["cu"] = cu
    options = dict(beta_sigmoid=False, qk_l2norm=False) if conventions else {}
    return lambda: prepare(q, k, g, beta, **x, cu_seqlens=cu, **options)


def run_cases():
    case("fixed serial safe", prefill_case(2, 80, 4))
    case("fixed fused H64", prefill_case(2, 1024, 64))
    case("varlen pool fp32 kv", prefill_case(1, 120, 4, lengths=[7, 33, 80], layout="kv", pool_dtype=torch.float32))
    case(
        "varlen pool bf16 status", prefill_case(1, 120, 4, lengths=[7, 33, 80], pool_dtype=torch.bfloat16, status=True)
    )
    case("softplus varlen", prefill_case(1, 120, 4, lengths=[40, 80], gate="softplus"))
    case("precomputed fixed", prefill_case(1, 64, 4, gate="precomputed"))
    case("conventions", prefill_case(1, 64, 4, conv=True))
    case("checkpoints varlen", prefill_case(1, 160, 4, lengths=[64, 96], ckpt=True))
    case("checkpoints fixed fused", prefill_case(2, 1024, 64, ckpt=True))
    case("cp varlen", prefill_case(1, 4096, 4, lengths=[1024, 3072], cp=True))
    case("cp fixed ckpt", prefill_case(1, 4096, 4, cp=True, ckpt=True))
    case(
        "pieces varlen pool",
        prefill_case(1, 2048, 4, lengths=[1500, 548], pool_dtype=torch.float32, cp="truncated", fused=False),
    )
    case(
        "fused pieces varlen pool",
        prefill_case(1, 4096, 4, lengths=[3000, 1096], pool_dtype=torch.float32, cp="truncated"),
    )
    case("fwd pool", prefill_case(1, 120, 4, lengths=[7, 33, 80], pool_dtype=torch.float32, fwd=True))
    case("k1 alone softplus", k1_case([40, 60], "softplus", False))
    case("k1 alone safe conventions", k1_case([100], "safe", True))
    case("decode T1 fp32", decode_case(32, 1, 12))
    case("decode T4 bf16 chunk", decode_case(8, 4, 12, bf16=True))
    case("decode T3 kv inter status", decode_case(4, 3, 4, layout="kv", inter=True, status=True))
    case("decode softplus flat", decode_case(6, 2, 8, gate="softplus", flat=True))
    case("decode precomputed H96", decode_case(64, 1, 96, gate="precomputed"))
    if hasattr(cula_aot, "kda_decode_layer"):
        case("layer T1 fp32", layer_case(32, 1, 12))
        case("layer T4 bf16 verify", layer_case(8, 4, 12, bf16=True, speculative=True, verify=True))
    if hasattr(cula_aot, "DecodeLayerStep"):
        case("layer step T4 bf16 verify", layer_case(8, 4, 12, bf16=True, speculative=True, verify=True, step=True))


def host_us(fn) -> float:
    """Median over 15 bursts of 500 calls of the host µs per call (after 200 warm-up calls)."""
    for _ in range(200):
        fn()
    samples = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(500):
            fn()
        samples.append((time.perf_counter() - start) / 500 * 1e6)
    return statistics.median(samples)


if HOST_US:
    for name, make in (
        ("prefill pool H12 1x2048 (cached plan)", lambda: prefill_case(1, 2048, 12, pool_dtype=torch.float32)),
        ("decode N32 H12 T1", lambda: decode_case(32, 1, 12)),
        ("decode N32 H12 T4 bf16 pool", lambda: decode_case(32, 4, 12, bf16=True)),
        *(
            [
                ("layer N32 H12 T1", lambda: layer_case(32, 1, 12)),
                ("layer N32 H12 T4 verify", lambda: layer_case(32, 4, 12, speculative=True, verify=True)),
                ("layer step N32 H12 T1", lambda: layer_case(32, 1, 12, step=True)),
                (
                    "layer step N32 H12 T4 verify",
                    lambda: layer_case(32, 4, 12, speculative=True, verify=True, step=True),
                ),
            ]
            if hasattr(cula_aot, "DecodeLayerStep")
            else []
        ),
    ):
        print(f"{name}: {host_us(make()):.1f} us")
else:
    run_cases()
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=0, default=str)
    print({k: (len(v) if isinstance(v, list) else v) for k, v in results.items()})
