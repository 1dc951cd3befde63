"""kda_decode_layer on the GPU against the float64 layer step (``reference.kda_decode_layer``).

Every case poisons ``out``, draws fresh inputs (q, k, v, g and the output gate as token-strided
views of one fused projection, β at an unaligned offset), a recurrent pool and a conv-state pool
with more slots than requests, and checks: the output and the new recurrent states (rel-RMSE
within CONTRACT §8's 1e-2), the new conv states exactly (they are copies of inputs), padding
rows' zero outputs, and that no slot outside the call changed in either pool.  Decay regimes:
standard, mixed (4 long-memory channels per head) and slow.
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.ops.decode_layer import decode_layer
from cula_aot.specs import LAYER_VARIANTS, draft_mark
from tests.decode_helpers import from_pool_layout
from tests.helpers import fresh_seed

pytestmark = pytest.mark.gpu

BOUND = 1e-2
D = 128
W = 4


def _inputs(n, tokens, heads, gen, gate, regime):
    width = 5 * heads * D + 24
    fused = torch.randn(n, tokens, width, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, g, z = (fused[..., i * heads * D : (i + 1) * heads * D].unflatten(-1, (heads, D)) for i in range(5))
    beta = torch.randn(n, tokens, heads + 3, generator=gen, device="cuda").to(torch.bfloat16)[..., 1 : heads + 1]
    gate_args = {"gate": gate}
    if gate != "precomputed":
        a_log = torch.log(torch.rand(heads, generator=gen, device="cuda") * 15 + 1).float()
        dt_bias = 0.1 * torch.randn(heads, D, generator=gen, device="cuda")
        if regime == "slow":
            a_log = torch.full((heads,), -4.0, device="cuda")
        if regime == "mixed":  # four long-memory channels per head beside fast ones
            dt_bias[:, :4] = -12.0
        gate_args.update(A_log=a_log, dt_bias=dt_bias)
        if gate == "safe":
            gate_args["lower_bound"] = -0.05 if regime == "slow" else -5.0
    else:  # g is the log-decay itself
        scale = 0.02 if regime == "slow" else 1.0
        g = (-scale * torch.rand(n, tokens, heads, D, generator=gen, device="cuda")).to(torch.bfloat16)
    return q, k, v, g, beta, z, gate_args


def _conv_pool(slots, channels, dtype, layout, gen):
    """The conv-state pool as the kernel is given it, and its values as [slots, 3C, 3] float64."""
    values = torch.randn(slots, 3 * channels, W - 1, generator=gen, device="cuda").to(dtype)
    if layout == "dim":
        return values.clone(), lambda arg: arg
    if layout == "token":
        return values.transpose(1, 2).contiguous(), lambda arg: arg.transpose(1, 2)
    # fla's caches: three [slots, C, 4] tensors whose last three taps are the state
    caches = []
    for i in range(3):
        cache = torch.randn(slots, channels, W, generator=gen, device="cuda").to(dtype)
        cache[..., 1:] = values[:, i * channels : (i + 1) * channels]
        caches.append(cache)
    return tuple(c[..., 1:] for c in caches), lambda arg: torch.cat(list(arg), 1)


def _run_case(
    n,
    tokens,
    heads,
    *,
    pool_dtype=torch.float32,
    layout="vk",
    conv_dtype=torch.bfloat16,
    conv_layout="dim",
    weight_dtype=torch.bfloat16,
    bias=True,
    padding=(),
    variant=None,
    gate="safe",
    regime="standard",
    flat=False,
):
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g, beta, z, gate_args = _inputs(n, tokens, heads, gen, gate, regime)
    channels = heads * D
    slots = n + 5
    pool = (0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).to(pool_dtype)
    conv_arg, as_dim = _conv_pool(slots, channels, conv_dtype, conv_layout, gen)
    weight = (0.5 * torch.randn(3 * channels, 1, W, generator=gen, device="cuda")).to(weight_dtype)
    conv_bias = (0.1 * torch.randn(3 * channels, generator=gen, device="cuda")).to(weight_dtype) if bias else None
    norm_weight = (1 + 0.1 * torch.randn(D, generator=gen, device="cuda")).to(weight_dtype)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.int32)
    for i in padding:
        perm[i] = -1 if i % 2 == 0 else -7
    pool_before = pool.clone()
    conv_before = as_dim(conv_arg).clone()
    out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    flat_args = (lambda t: t.flatten(0, 1)) if flat else (lambda t: t)
    o = decode_layer(
        *(flat_args(t) for t in (q, k, v, g, beta)),
        conv_weight=weight,
        conv_bias=conv_bias,
        conv_state=conv_arg,
        conv_layout="token" if conv_layout == "token" else "dim",
        out_gate=flat_args(z),
        norm_weight=norm_weight,
        state_pool=pool,
        state_indices=perm.cuda(),
        out=flat_args(out),
        state_layout=layout,
        num_tokens=tokens if flat else None,
        variant=variant,
        **gate_args,
    )
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    valid = [i for i in range(n) if i not in padding]
    rows = perm[valid].long()
    wq, wk, wv = weight.squeeze(1).double().split(channels)
    biases = None if conv_bias is None else tuple(conv_bias.double().split(channels))
    states = tuple(conv_before[rows].double().split(channels, 1))
    ref_y, ref_s, ref_conv = reference.kda_decode_layer(
        *(t[valid].double() for t in (q, k, v, g, beta)),
        conv_weights=(wq, wk, wv),
        conv_biases=biases,
        conv_states=states,
        initial_state=from_pool_layout(pool_before[rows].double(), layout).transpose(-1, -2),
        norm_weight=norm_weight.double(),
        out_gate=z[valid].double(),
        A_log=gate_args.get("A_log"),
        dt_bias=gate_args.get("dt_bias"),
        lower_bound=gate_args.get("lower_bound"),
        gate_kind=gate,
    )
    report = f"layer N={n} T={tokens} H={heads} {gate}/{regime} variant={variant} seed={seed}"
    assert torch.isfinite(out[valid]).all(), f"{report}: unwritten or non-finite output"
    err_o = reference.rel_rmse(out[valid], ref_y)
    got_s = from_pool_layout(pool[rows], layout).transpose(-1, -2)
    err_s = reference.rel_rmse(got_s, ref_s)
    report += f": o rel-RMSE {err_o:.2e}, state rel-RMSE {err_s:.2e}"
    conv_after = as_dim(conv_arg)
    want_conv = torch.cat(ref_conv, 1).to(conv_dtype)
    assert torch.equal(conv_after[rows], want_conv), f"{report}: conv states differ from the window's last inputs"
    if padding:
        assert bool((out[list(padding)] == 0).all()), f"{report}: padding rows' outputs are not zero"
    untouched = [s for s in range(slots) if s not in set(rows.tolist())]
    assert torch.equal(pool[untouched], pool_before[untouched]), f"{report}: a recurrent slot no request owns changed"
    assert torch.equal(conv_after[untouched], conv_before[untouched]), f"{report}: a conv slot no request owns changed"
    print(report)
    assert err_o <= BOUND and err_s <= BOUND, report


@pytest.mark.parametrize("variant", LAYER_VARIANTS)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize("regime", ["standard", "mixed", "slow"])
def test_every_variant_in_every_regime(variant, tokens, regime):
    """Every built CTA split (a cluster of 4, 2 or 1 CTAs per head), the conv window's three
    cases (T < 3 shifts old taps, T = 3 replaces them, T > 3), both pool dtypes and layouts."""
    for pool_dtype, layout in ((torch.float32, "vk"), (torch.bfloat16, "kv")):
        _run_case(6, tokens, 8, pool_dtype=pool_dtype, layout=layout, padding=(4,), variant=variant, regime=regime)


@pytest.mark.parametrize("gate", ["safe", "softplus", "precomputed"])
@pytest.mark.parametrize("regime", ["standard", "slow"])
def test_gates(gate, regime):
    for variant in LAYER_VARIANTS:
        _run_case(5, 4, 4, gate=gate, regime=regime, variant=variant, padding=(0,))


CASES = [  # conv-state dtype, conv layout, weight dtype, bias, flat input, N, T, H
    (torch.float32, "dim", torch.bfloat16, True, False, 33, 1, 12),
    (torch.bfloat16, "token", torch.float32, False, False, 7, 2, 16),
    (torch.bfloat16, "fla", torch.bfloat16, False, True, 32, 1, 12),
    (torch.float32, "token", torch.float32, True, True, 9, 5, 3),
    (torch.bfloat16, "dim", torch.bfloat16, True, False, 64, 1, 24),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_conv_forms_and_dispatch(case):
    """The conv-state and weight dtypes, the three conv-state forms (dim-major, token-major and
    fla's [N, C, 4] caches), token-major 3-D input, and the variant the dispatch picks."""
    conv_dtype, conv_layout, weight_dtype, bias, flat, n, tokens, heads = CASES[case]
    _run_case(
        n,
        tokens,
        heads,
        conv_dtype=conv_dtype,
        conv_layout=conv_layout,
        weight_dtype=weight_dtype,
        bias=bias,
        flat=flat,
        padding=(1,),
    )


def _spec_step_inputs(n, tokens, heads, gen, regime, gate_args=None):
    """A step's inputs; the layer's gate parameters are drawn once (pass the first step's back):
    a committed draft's decays are the ones it was drafted with."""
    q, k, v, g, beta, z, drawn = _inputs(n, tokens, heads, gen, "safe", regime)
    return dict(q=q, k=k, v=v, g=g, beta=beta, z=z), gate_args or drawn


def _reference_step(x, rows, state, conv, weights, biases, norm_weight, gate_args, count=None):
    """The float64 layer on the first ``count`` tokens of ``x``'s rows ``rows`` from (state, conv)."""
    count = x["q"].shape[1] if count is None else count
    sel = {name: t[rows, :count].double() for name, t in x.items()}
    return reference.kda_decode_layer(
        sel["q"],
        sel["k"],
        sel["v"],
        sel["g"],
        sel["beta"],
        conv_weights=weights,
        conv_biases=biases,
        conv_states=conv,
        initial_state=state,
        norm_weight=norm_weight,
        out_gate=sel["z"],
        A_log=gate_args["A_log"],
        dt_bias=gate_args["dt_bias"],
        lower_bound=gate_args["lower_bound"],
    )


@pytest.mark.parametrize("regime", ["standard", "slow"])
@pytest.mark.parametrize(
    "pool_dtype,layout,conv_dtype",
    [
        (torch.float32, "vk", torch.bfloat16),
        (torch.bfloat16, "kv", torch.bfloat16),
        (torch.float32, "kv", torch.float32),
    ],
)
def test_speculative_verify_commits_the_accepted_prefix(regime, pool_dtype, layout, conv_dtype):
    """32 verify calls of 1..8 draft tokens, each committing a random prefix (0..T) of the one
    before, against a float64 run that never speculates (it applies only the accepted tokens):
    every verify output, the committed recurrent and conv states after every call, and a last
    plain call that commits and advances.  One request is padding throughout.  An fp32 conv
    state starts from values bf16 cannot hold: the commit recomputes k̂ from the committed taps,
    which must be carried exactly."""
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed)
    n, heads, slots = 5, 4, 9
    channels = heads * D
    pool = (0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).to(pool_dtype)
    conv_pool = torch.randn(slots, 3 * channels, W - 1, generator=gen, device="cuda").to(conv_dtype)
    weight = (0.5 * torch.randn(3 * channels, W, generator=gen, device="cuda")).to(torch.bfloat16)
    conv_bias = (0.1 * torch.randn(3 * channels, generator=gen, device="cuda")).to(torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(D, generator=gen, device="cuda")).to(torch.bfloat16)
    drafts = cula_aot.draft_buffers(slots, heads, "cuda")
    perm = torch.randperm(slots, generator=cpu)[:n].to(torch.int32)
    perm[2] = -1
    indices = perm.cuda()
    rows = [i for i in range(n) if i != 2]
    owned = perm[rows].long()
    weights = tuple(weight.double().split(channels))
    biases = tuple(conv_bias.double().split(channels))
    state = from_pool_layout(pool[owned].double(), layout).transpose(-1, -2)  # [n, H, V, K] float64
    conv = tuple(conv_pool[owned].double().split(channels, 1))
    pool_before, conv_before = pool.clone(), conv_pool.clone()
    previous, accepted, gate_args = None, torch.zeros(n, dtype=torch.int32), None
    for step in range(33):
        last = step == 32
        tokens = 1 if last else int(torch.randint(1, 9, (1,), generator=cpu))
        x, gate_args = _spec_step_inputs(n, tokens, heads, gen, regime, gate_args)
        if previous is not None:  # the reference commits what the kernel is told was accepted
            for r, row in enumerate(rows):
                a = int(accepted[row])
                if a:
                    px = {name: t[row : row + 1] for name, t in previous.items()}
                    one_conv = tuple(c[r : r + 1] for c in conv)
                    _, s_new, c_new = _reference_step(
                        px, [0], state[r : r + 1], one_conv, weights, biases, norm_weight.double(), gate_args, a
                    )
                    state[r] = s_new[0]
                    conv = tuple(torch.cat([c[:r], cn, c[r + 1 :]]) for c, cn in zip(conv, c_new))
        out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        cula_aot.kda_decode_layer(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            conv_weight=weight,
            conv_bias=conv_bias,
            conv_state=conv_pool,
            out_gate=x["z"],
            norm_weight=norm_weight,
            state_pool=pool,
            state_indices=indices,
            out=out,
            state_layout=layout,
            drafts=drafts,
            num_accepted=accepted.cuda(),
            verify=not last,
            **gate_args,
        )
        torch.cuda.synchronize()
        ref_y, ref_s, ref_conv = _reference_step(x, rows, state, conv, weights, biases, norm_weight.double(), gate_args)
        report = f"speculative {regime} {pool_dtype} {layout} conv {conv_dtype} step {step} T={tokens} seed={seed}"
        err_o = reference.rel_rmse(out[rows], ref_y)
        assert err_o <= BOUND, f"{report}: o rel-RMSE {err_o:.2e}"
        assert bool((out[2] == 0).all()), f"{report}: the padding row's outputs are not zero"
        got_state = from_pool_layout(pool[owned], layout).transpose(-1, -2)
        want_state = ref_s if last else state
        err_s = reference.rel_rmse(got_state, want_state)
        assert err_s <= BOUND, f"{report}: committed state rel-RMSE {err_s:.2e}"
        want_conv = torch.cat(ref_conv if last else conv, 1).to(conv_dtype)
        assert torch.equal(conv_pool[owned], want_conv), f"{report}: the committed conv state differs"
        if not last:  # every head of every request marks its draft: bank and length
            marks = drafts.marks[owned]
            assert bool(((marks - 1) // 2 == tokens).all()), f"{report}: a pending draft is not marked"
        else:
            assert not drafts.marks.any(), f"{report}: a draft is still pending"
        previous = x
        accepted = torch.tensor(
            [int(torch.randint(0, tokens + 1, (1,), generator=cpu)) for _ in range(n)], dtype=torch.int32
        )
    untouched = [s for s in range(slots) if s not in set(owned.tolist())]
    assert torch.equal(pool[untouched], pool_before[untouched]) and torch.equal(
        conv_pool[untouched], conv_before[untouched]
    ), "a slot no request owns changed"


def test_a_commit_spans_waves():
    """Enough requests and heads that one call's CTAs run in several waves (128 × 32 heads in
    clusters of two: 8 192 CTAs), so heads of one request commit and re-mark their drafts at
    different times: three verify steps and a plain one, every head's committed state against
    the float64 run of the accepted tokens."""
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, heads, slots, tokens = 128, 32, 130, 2
    channels = heads * D
    pool = (0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).float()
    conv_pool = torch.randn(slots, 3 * channels, W - 1, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (0.5 * torch.randn(3 * channels, W, generator=gen, device="cuda")).to(torch.bfloat16)
    norm_weight = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    drafts = cula_aot.draft_buffers(slots, heads, "cuda")
    indices = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.int32).cuda()
    rows = list(range(n))
    owned = indices.long()
    weights = tuple(weight.double().split(channels))
    state = pool[owned].double()  # a "vk" pool holds [V, K] per head, as the reference takes it
    conv = tuple(conv_pool[owned].double().split(channels, 1))
    previous, accepted, gate_args = None, torch.zeros(n, dtype=torch.int32), None
    for step in range(4):
        last = step == 3
        x, gate_args = _spec_step_inputs(n, tokens, heads, gen, "standard", gate_args)
        if previous is not None:
            for a in range(1, tokens + 1):  # commit in the reference, grouped by accepted count
                group = [r for r in rows if int(accepted[r]) == a]
                if group:
                    _, s_new, c_new = _reference_step(
                        previous,
                        group,
                        state[group],
                        tuple(c[group] for c in conv),
                        weights,
                        None,
                        norm_weight.double(),
                        gate_args,
                        a,
                    )
                    state[group] = s_new
                    for c, cn in zip(conv, c_new):
                        c[group] = cn
        cula_aot.kda_decode_layer(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            conv_weight=weight,
            conv_state=conv_pool,
            out_gate=x["z"],
            norm_weight=norm_weight,
            state_pool=pool,
            state_indices=indices,
            drafts=drafts,
            num_accepted=accepted.cuda(),
            verify=not last,
            **gate_args,
        )
        torch.cuda.synchronize()
        if last:
            _, want, want_conv = _reference_step(x, rows, state, conv, weights, None, norm_weight.double(), gate_args)
        else:
            want, want_conv = state, conv
        err = reference.rel_rmse(pool[owned].double(), want)
        assert err <= BOUND, f"step {step} seed {seed}: committed state rel-RMSE {err:.2e}"
        assert torch.equal(conv_pool[owned], torch.cat(want_conv, 1).to(torch.bfloat16)), f"step {step}: conv state"
        previous = x
        accepted = torch.randint(
            0, tokens + 1, (n,), generator=torch.Generator().manual_seed(seed + step), dtype=torch.int32
        )


def test_hostile_draft_values_are_bounded_and_reported():
    """A mark that no draft writes is no pending draft, and a num_accepted outside [0, the pending
    draft's T] is clamped, each reported in the status word; the marks of slots outside the call
    stay as they were."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    n, heads, slots = 2, 2, 4
    x, gate_args = _spec_step_inputs(n, 2, heads, gen, "standard")
    channels = heads * D
    common = dict(
        conv_weight=(0.5 * torch.randn(3 * channels, W, generator=gen, device="cuda")).to(torch.bfloat16),
        conv_state=torch.randn(slots, 3 * channels, W - 1, generator=gen, device="cuda").to(torch.bfloat16),
        out_gate=x["z"],
        norm_weight=torch.ones(D, device="cuda", dtype=torch.bfloat16),
        state_pool=torch.zeros(slots, heads, D, D, device="cuda"),
        state_indices=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        **gate_args,
    )
    inputs = [x[name] for name in ("q", "k", "v", "g", "beta")]
    two_tokens = draft_mark(0, 2)
    for marks, accepted in (([1, 0, 0, 0], [0, 0]), ([19, 0, 0, 0], [0, 0]), ([two_tokens, two_tokens, 0, 0], [3, -1])):
        drafts = cula_aot.draft_buffers(slots, heads, "cuda")
        drafts.marks.copy_(torch.tensor(marks, dtype=torch.int32)[:, None].expand(slots, heads))
        status = torch.zeros(1, dtype=torch.int32, device="cuda")
        out = cula_aot.kda_decode_layer(
            *inputs,
            **common,
            drafts=drafts,
            num_accepted=torch.tensor(accepted, dtype=torch.int32, device="cuda"),
            verify=True,
            status=status,
        )
        torch.cuda.synchronize()
        assert int(status) & cula_aot.STATUS_DRAFT_OUT_OF_RANGE, (marks, accepted)
        assert torch.isfinite(out).all()
        assert not drafts.marks[2:].any()


def test_graph_replay_matches_eager_steps():
    """A verify step captured once in a CUDA graph and replayed with new inputs and accepted
    counts copied into its static buffers equals the same steps run eagerly on copies of the
    pools (bit for bit: the same kernel on the same values)."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    n, heads, slots, tokens = 4, 4, 6, 3
    channels = heads * D
    pool = (0.1 * torch.randn(slots, heads, D, D, generator=gen, device="cuda")).float()
    conv_pool = torch.randn(slots, 3 * channels, W - 1, generator=gen, device="cuda").to(torch.bfloat16)
    drafts = cula_aot.draft_buffers(slots, heads, "cuda")
    static, gate_args = _spec_step_inputs(n, tokens, heads, gen, "standard")
    static = {name: t.clone() for name, t in static.items()}
    accepted = torch.zeros(n, dtype=torch.int32, device="cuda")
    indices = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device="cuda")
    weight = (0.5 * torch.randn(3 * channels, W, generator=gen, device="cuda")).to(torch.bfloat16)
    norm_weight = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, tokens, heads, D, device="cuda", dtype=torch.bfloat16)

    def step(pool, conv_pool, drafts, x, accepted, out):
        cula_aot.kda_decode_layer(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            conv_weight=weight,
            conv_state=conv_pool,
            out_gate=x["z"],
            norm_weight=norm_weight,
            state_pool=pool,
            state_indices=indices,
            out=out,
            drafts=drafts,
            num_accepted=accepted,
            verify=True,
            **gate_args,
        )

    def copies():
        return pool.clone(), conv_pool.clone(), cula_aot.Drafts(drafts.records.clone(), drafts.marks.clone())

    step(*copies(), static, accepted, torch.empty_like(out))  # loads the kernel, builds the plan
    eager = copies()
    from benchmarks.timing import capture_graph

    graph = capture_graph(lambda: step(pool, conv_pool, drafts, static, accepted, out), warmup=0)
    for i in range(5):
        x, _ = _spec_step_inputs(n, tokens, heads, gen, "standard")
        counts = torch.randint(0, tokens + 1, (n,), generator=gen, device="cuda", dtype=torch.int32)
        for name, t in x.items():
            static[name].copy_(t)
        accepted.copy_(counts)
        graph.replay()
        eager_out = torch.empty_like(out)
        step(*eager, x, counts, eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"replay {i}: outputs differ"
        assert torch.equal(pool, eager[0]) and torch.equal(conv_pool, eager[1]), f"replay {i}: states differ"
        assert torch.equal(drafts.marks, eager[2].marks), f"replay {i}: marks differ"
