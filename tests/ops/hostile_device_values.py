"""Hostile device values: the cu_seqlens and state_indices a broken scheduler could pass, on
every path (serial K1 + K2, fused, intracard CP, decode, and decode's per-token slots with
vLLM's ``[N, T]`` tables and ``num_accepted`` counts), with guard regions around every output.

Each hostile call must finish without a CUDA error, leave every guard bitwise unchanged and set
the status bits its values call for; the correct call after it must return bitwise what it
returned before any hostile call (the context survives and nothing stale leaks into it).  A
slot outside the pool must behave as padding: bitwise the call with that index set to -1.

    python3 -m tests.ops.hostile_device_values [--no-reference]   # what benchmarks/sanitize.sh runs

The GPU test (``test_hostile_device_values_gpu.py``) runs the same cases and also checks each
path's correct call against the float64 reference.
"""

import argparse
import random

import torch

from cula_aot import (
    STATUS_CU_SEQLENS_MALFORMED,
    STATUS_DRAFT_OUT_OF_RANGE,
    STATUS_SLOT_OUT_OF_RANGE,
    kda_decode,
    reference,
)
from cula_aot.ops.prefill import prefill
from tests.helpers import cu_seqlens_of, fresh_seed, standard_inputs

HEADS = 2
LENGTHS = [300, 150, 62]  # the 300-token sequence splits under intracard_cp=2
TOTAL = sum(LENGTHS)
SLOTS = 4
GOOD_INDICES = [2, 0, 3]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
BOUND = 1e-2  # rel-RMSE against float64, as the serving tests

# cu_seqlens of the 3 sequences over TOTAL tokens: decreasing, negative, past T, huge, not from 0.
HOSTILE_CU = [
    [0, 300, 100, TOTAL],
    [0, -64, 64, TOTAL],
    [0, 100, 300, 5000],
    [0, INT32_MAX, 5, TOTAL],
    [0, 100, INT32_MIN, TOTAL],
    [16, 300, 450, TOTAL],
    [-7, 300, 450, TOTAL],
    [INT32_MIN, INT32_MAX, INT32_MIN, INT32_MAX],
    [TOTAL, 0, TOTAL, 0],
    [0, 0, 0, INT32_MAX],
]
# Pool indices for the 3 sequences of a 4-slot pool: past the pool, huge, negative other than -1.
HOSTILE_INDICES = [
    [4, 9, 0],
    [2**20, 1, 2],
    [-2, 3, INT32_MIN],
    [INT32_MAX, -1, 1],
    [SLOTS, SLOTS + 1, -3],
]


# Per-token slots: 3 sequences of TOKENS tokens, a pool of TOKEN_SLOTS slots; (table, counts).
TOKENS = 3
TOKEN_SLOTS = 3 * TOKENS + 2
GOOD_TABLE = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
GOOD_COUNTS = [1, 3, 2]
HOSTILE_TOKEN_SLOTS = [
    (GOOD_TABLE, [INT32_MIN, 0, INT32_MAX]),  # counts clamped to [1, T]
    (GOOD_TABLE, [-1, TOKENS + 1, 2**20]),
    ([[INT32_MAX, 1, 2], [3, INT32_MIN, 5], [6, 7, 2**20]], GOOD_COUNTS),  # bad write slots
    ([[-2, 1, 2], [3, 4, TOKEN_SLOTS], [-1, 7, 8]], [1, 3, 1]),  # bad or -1 read slots: padding rows
    ([[-1, 1, INT32_MIN], [3, 4, 5], [6, 7, 8]], [1, 1, INT32_MIN]),  # a padding row's writes go unread
]


def random_cases(rng: random.Random, count: int) -> tuple[list, list]:
    """More hostile draws: entries around [0, T] and at the int32 extremes, indices around the pool."""
    values = [INT32_MIN, -1, 0, 1, 15, 16, 17, TOTAL - 1, TOTAL, TOTAL + 1, INT32_MAX]
    cus = [
        [rng.choice(values) if rng.random() < 0.3 else rng.randint(-2 * TOTAL, 2 * TOTAL) for _ in range(4)]
        for _ in range(count)
    ]
    indices = []
    for _ in range(count):
        free = rng.sample(range(SLOTS), 3)  # in-pool slots distinct: two sequences on one slot race
        indices.append(
            [
                rng.choice([INT32_MIN, -2, -1, SLOTS, SLOTS + 7, INT32_MAX]) if rng.random() < 0.5 else slot
                for slot in free
            ]
        )
    return cus, indices


def malformed(cu: list, total: int) -> bool:
    """The kernels' rule (``layout.STATUS_CU_SEQLENS_MALFORMED``): an entry outside [0, T], a
    decrease, or a first entry other than 0 (a last entry below T is not: rows past it are unused)."""
    return cu[0] != 0 or any(not 0 <= c <= total for c in cu) or any(b < a for a, b in zip(cu, cu[1:]))


def slot_bad(indices: list) -> bool:
    return any(i >= SLOTS or i < -1 for i in indices)


def token_slot_cases(rng: random.Random, count: int) -> list:
    """More hostile tables and counts: entries around the pool and at the int32 extremes."""
    slots = [INT32_MIN, -2, -1, TOKEN_SLOTS, TOKEN_SLOTS + 7, INT32_MAX]
    counts = [INT32_MIN, -1, 0, 1, TOKENS, TOKENS + 1, INT32_MAX]
    cases = []
    for _ in range(count):
        free = rng.sample(range(TOKEN_SLOTS), 3 * TOKENS)  # in-pool slots distinct: no two writes race
        table = [[rng.choice(slots) if rng.random() < 0.3 else free.pop() for _ in range(TOKENS)] for _ in range(3)]
        cases.append((table, [rng.choice(counts) if rng.random() < 0.5 else rng.randint(1, TOKENS) for _ in range(3)]))
    return cases


def token_slot_status(table: list, counts: list) -> int:
    """The bits kda_decode's per-token slots report (CONTRACT §10): a count outside [1, T]
    (clamped); a read slot outside the pool other than -1 (the row is padding, its write slots
    unread); in any other row, a write slot outside the pool other than -1."""
    bits = 0
    for row, count in zip(table, counts):
        column = min(max(count - 1, 0), TOKENS - 1)
        bits |= STATUS_DRAFT_OUT_OF_RANGE if column != count - 1 else 0
        read = row[column]
        checked = [read] if not 0 <= read < TOKEN_SLOTS else row
        bits |= STATUS_SLOT_OUT_OF_RANGE if any(s >= TOKEN_SLOTS or s < -1 for s in checked) else 0
    return bits


class Guarded:
    """A view of ``size`` entries along ``dim`` inside one allocation with ``guard`` entries of a
    fixed random pattern on each side."""

    def __init__(self, shape, dim, guard, dtype, seed):
        outer = list(shape)
        outer[dim] += 2 * guard
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.backing = torch.randn(outer, generator=gen, device="cuda").to(dtype)
        self.view = self.backing.narrow(dim, guard, shape[dim])
        self.dim, self.guard, self.size = dim, guard, shape[dim]
        self.saved = [g.clone() for g in self._guards()]

    def _guards(self):
        return (
            self.backing.narrow(self.dim, 0, self.guard),
            self.backing.narrow(self.dim, self.guard + self.size, self.guard),
        )

    def intact(self) -> bool:
        return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(self._guards(), self.saved))


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


class Harness:
    """One prefill or decode path with its guarded output and pool, the pool's start values, and
    the correct call's results.  ``varlen``: the path takes a ``cu_seqlens``; ``reads_device_cu``:
    its kernels read the device copy (CP plans from the host copy); ``inputs``: the prefill
    inputs its correct call is checked with against float64 (None: decode, tested elsewhere)."""

    def __init__(self, name, call, out_shape, out_dim, pool_dtype, seed, *, varlen, reads_device_cu, inputs):
        self.name, self.call = name, call
        self.varlen, self.reads_device_cu, self.inputs = varlen, reads_device_cu, inputs
        self.out = Guarded(out_shape, out_dim, 3, torch.bfloat16, seed)
        self.pool = Guarded((SLOTS, HEADS, 128, 128), 0, 1, pool_dtype, seed + 1)
        self.pool_start = (0.1 * torch.randn(SLOTS, HEADS, 128, 128, device="cuda")).to(pool_dtype)
        self.status = torch.zeros(4, dtype=torch.int32, device="cuda")[:1]
        self.expected = None

    def run(self, cu, indices):
        """One call from the pool's start values; returns (out, pool, status) copies."""
        self.pool.view.copy_(self.pool_start)
        self.out.view.fill_(float("nan"))
        self.status.zero_()
        self.call(self, cu, torch.tensor(indices, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()  # a CUDA error surfaces here
        return self.out.view.clone(), self.pool.view.clone(), int(self.status.item())

    def baseline(self):
        self.expected = self.run(None, GOOD_INDICES)
        assert self.expected[2] == 0, f"{self.name}: a correct call set status {self.expected[2]}"

    def check(self, cu, indices, failures: list):
        """One hostile call, then the correct call; appends what went wrong to ``failures``."""
        label = f"{self.name} cu={cu} indices={indices}"
        o, pool, status = self.run(cu, indices)
        want = (
            STATUS_CU_SEQLENS_MALFORMED if cu is not None and self.reads_device_cu and malformed(cu, TOTAL) else 0
        ) | (STATUS_SLOT_OUT_OF_RANGE if slot_bad(indices) else 0)
        if status != want:
            failures.append(f"{label}: status {status}, want {want}")
        if not (self.out.intact() and self.pool.intact()):
            failures.append(f"{label}: a guard region was written")
        if cu is None or not self.reads_device_cu:
            # Well-defined results: the lengths are the correct ones (none given, or a path that
            # plans from the host copy), and an out-of-pool slot is padding, exactly as -1.
            padded = [i if 0 <= i < SLOTS else -1 for i in indices]
            if cu is not None or padded != list(indices):
                ref = self.run(None, padded)
                if not (torch.equal(_bits(o), _bits(ref[0])) and torch.equal(_bits(pool), _bits(ref[1]))):
                    failures.append(f"{label}: not bitwise the call with correct lengths and out-of-pool slots as -1")
        again = self.run(None, GOOD_INDICES)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(again[:2], self.expected[:2])) or again[2]:
            failures.append(f"{label}: the correct call after it changed")


def _prefill_path(x, good_cu, **options):
    def call(h, cu, indices):
        device_cu = good_cu if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
        extra = {"cu_seqlens_cpu": good_cu.cpu()} if options.get("intracard_cp") else {}
        prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            initial_state=h.pool.view,
            final_state=h.pool.view,
            state_indices=indices,
            out=h.out.view,
            cu_seqlens=None if good_cu is None else device_cu,
            status=h.status,
            **extra,
            **options,
        )

    return call


def _decode_path(x):
    def call(h, cu, indices):
        kda_decode(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            state_pool=h.pool.view,
            state_indices=indices,
            out=h.out.view,
            status=h.status,
        )

    return call


def check_token_slots(seed: int, cases: list) -> list:
    """Decode's per-token slots under hostile tables and counts: the status bits of
    ``token_slot_status``, every guard intact, and the correct call after each bitwise unchanged."""
    x = standard_inputs(3, TOKENS, HEADS, device="cuda", seed=seed + 5, slow_decay=True)
    out = Guarded((3, TOKENS, HEADS, 128), 0, 3, torch.bfloat16, seed + 6)
    pool = Guarded((TOKEN_SLOTS, HEADS, 128, 128), 0, 1, torch.float32, seed + 7)
    start = 0.1 * torch.randn(TOKEN_SLOTS, HEADS, 128, 128, device="cuda")
    status = torch.zeros(4, dtype=torch.int32, device="cuda")[:1]

    def call(table, counts):
        pool.view.copy_(start)
        out.view.fill_(float("nan"))
        status.zero_()
        kda_decode(
            *(x[name] for name in ("q", "k", "v", "g", "beta")),
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            state_pool=pool.view,
            state_indices=torch.tensor(table, dtype=torch.int32, device="cuda"),
            num_accepted=torch.tensor(counts, dtype=torch.int32, device="cuda"),
            out=out.view,
            status=status,
        )
        torch.cuda.synchronize()  # a CUDA error surfaces here
        return out.view.clone(), pool.view.clone(), int(status.item())

    expected = call(GOOD_TABLE, GOOD_COUNTS)
    failures = [] if expected[2] == 0 else [f"token slots: a correct call set status {expected[2]}"]
    for table, counts in cases:
        label = f"token slots table={table} counts={counts}"
        _, _, got = call(table, counts)
        want = token_slot_status(table, counts)
        if got != want:
            failures.append(f"{label}: status {got}, want {want}")
        if not (out.intact() and pool.intact()):
            failures.append(f"{label}: a guard region was written")
        again = call(GOOD_TABLE, GOOD_COUNTS)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(again[:2], expected[:2])) or again[2]:
            failures.append(f"{label}: the correct call after it changed")
    return failures


def harnesses(seed: int) -> list:
    x = standard_inputs(1, TOTAL, HEADS, device="cuda", seed=seed, slow_decay=True)
    fixed = standard_inputs(3, 160, HEADS, device="cuda", seed=seed + 1, slow_decay=True)
    cu = cu_seqlens_of(LENGTHS, "cuda")
    varlen_out = (1, TOTAL, HEADS, 128)
    varlen = dict(varlen=True, inputs=x)
    paths = [  # (name, call, out shape, out guard dim, pool dtype, options)
        (
            "serial",
            _prefill_path(x, cu, intracard_cp=False, fused=False),
            varlen_out,
            1,
            torch.float32,
            dict(varlen, reads_device_cu=True),
        ),
        (
            "fused",
            _prefill_path(x, cu, intracard_cp=False, fused=True),
            varlen_out,
            1,
            torch.bfloat16,
            dict(varlen, reads_device_cu=True),
        ),
        ("cp", _prefill_path(x, cu, intracard_cp=2), varlen_out, 1, torch.float32, dict(varlen, reads_device_cu=False)),
        (
            "serial fixed",
            _prefill_path(fixed, None, intracard_cp=False, fused=False),
            (3, 160, HEADS, 128),
            0,
            torch.float32,
            dict(varlen=False, reads_device_cu=False, inputs=fixed),
        ),
    ]
    for tokens, dtype in ((1, torch.float32), (2, torch.bfloat16)):  # token kernel, chunk kernel
        d = standard_inputs(3, tokens, HEADS, device="cuda", seed=seed + 2 + tokens)
        paths.append(
            (
                f"decode T={tokens} {dtype}",
                _decode_path(d),
                (3, tokens, HEADS, 128),
                0,
                dtype,
                dict(varlen=False, reads_device_cu=False, inputs=None),
            )
        )
    return [
        Harness(name, call, shape, dim, dtype, seed + 10 * n, **options)
        for n, (name, call, shape, dim, dtype, options) in enumerate(paths)
    ]


def check_reference(h) -> list:
    """The correct call of a prefill path against the float64 reference (decode has its own tests)."""
    x = h.inputs
    if x is None:
        return []
    cu = None if x["q"].shape[0] > 1 else cu_seqlens_of(LENGTHS, "cuda")
    start = torch.stack([h.pool_start[i].float().transpose(-1, -2) for i in GOOD_INDICES])
    ref_o, ref_s = reference.kda_chunked(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        initial_state=start,
        cu_seqlens=cu,
    )
    o, pool, _ = h.expected
    err_o = reference.rel_rmse(o, ref_o)
    err_s = max(reference.rel_rmse(pool[i].float().transpose(-1, -2), ref_s[n]) for n, i in enumerate(GOOD_INDICES))
    print(f"{h.name}: correct call o {err_o:.2e}, states {err_s:.2e} rel-RMSE against float64")
    return [] if err_o <= BOUND and err_s <= BOUND else [f"{h.name}: o {err_o:.2e} / states {err_s:.2e} > {BOUND}"]


def run(seed=None, with_reference=True, random_count=6) -> tuple[int, list]:
    """Every case on every path: (hostile calls made, failures)."""
    seed = fresh_seed() if seed is None else seed
    print(f"hostile device values, seed {seed}")
    rng = random.Random(seed)
    extra_cu, extra_indices = random_cases(rng, random_count)
    failures, calls = [], 0
    for h in harnesses(seed):
        h.baseline()
        if with_reference:
            failures += check_reference(h)
        cases = [(None, idx) for idx in HOSTILE_INDICES + extra_indices]
        if h.varlen:
            cases += [(cu, GOOD_INDICES) for cu in HOSTILE_CU + extra_cu]
            cases += [
                (cu, idx) for cu, idx in zip(HOSTILE_CU[:3] + extra_cu[:2], HOSTILE_INDICES[:3] + extra_indices[:2])
            ]
        for cu, idx in cases:
            h.check(cu, idx, failures)
        calls += len(cases)
        print(f"{h.name}: {len(cases)} hostile calls, {len(failures)} failures so far", flush=True)
    token_cases = HOSTILE_TOKEN_SLOTS + token_slot_cases(rng, random_count)
    failures += check_token_slots(seed, token_cases)
    calls += len(token_cases)
    print(f"decode token slots: {len(token_cases)} hostile calls, {len(failures)} failures so far", flush=True)
    return calls, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 checks (under memcheck)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--random", type=int, default=6, help="random draws of each kind besides the fixed cases")
    args = parser.parse_args()
    calls, failures = run(args.seed, with_reference=not args.no_reference, random_count=args.random)
    for f in failures:
        print("FAIL", f)
    print(f"hostile device values: {calls} hostile calls, {len(failures)} failures")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
