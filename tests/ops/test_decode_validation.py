"""Every kda_decode input rule raises a clear KDAInputError before anything is written (CPU only)."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from tests.decode_helpers import fused_inputs

N, T, H, D = 3, 2, 4, 128


@pytest.fixture
def args():
    x = fused_inputs(N, T, H, device="cpu", seed=0)
    x["state_pool"] = torch.zeros(N + 2, H, D, D)
    x["state_indices"] = torch.tensor([0, 3, -1], dtype=torch.int32)
    return x


def _call(args, **overrides):
    a = {**args, **overrides}
    return cula_aot.kda_decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


def test_valid_cpu_input_is_refused_only_for_its_device(args):
    with pytest.raises(KDAInputError, match="inputs are on cpu: .*CUDA.*\\.cuda\\(\\)"):
        _call(args)
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        _call(
            args,
            state_pool=torch.zeros(N, H, D, D, dtype=torch.bfloat16),
            state_layout="kv",
            intermediate_states=torch.zeros(N, T, H, D, D, dtype=torch.bfloat16),
        )


def _padded_pool(pad, dtype=torch.float32):
    storage = torch.zeros((N + 1) * (H * D * D + pad), dtype=dtype)
    return storage.as_strided((N + 1, H, D, D), (H * D * D + pad, D * D, D, 1))


RULES = [
    (lambda x: {"q": x["q"].float()}, "q must be torch.bfloat16, got torch.float32"),
    (lambda x: {"q": "nope"}, "q must be a torch.Tensor"),
    (lambda x: {"q": x["q"][0, 0]}, r"q must be \[N, T, H, 128\]"),
    (lambda x: {"q": x["q"][..., :64]}, "head dim must be 128"),
    (lambda x: {"k": x["k"][:, :, :1]}, r"k must have shape \[3, 2, 4, 128\]"),
    (
        lambda x: {"v": x["v"].transpose(1, 2).contiguous().transpose(1, 2)},
        "v must have unit stride along D and head stride 128",
    ),
    (lambda x: {"g": torch.zeros(N, T, H, 256, dtype=torch.bfloat16)[..., ::2]}, "g must have unit stride along D"),
    (
        lambda x: {"k": torch.zeros(N * T * H * D + 8, dtype=torch.bfloat16)[4 : 4 + N * T * H * D].view(N, T, H, D)},
        "k must start on a 16-byte boundary",
    ),
    (
        lambda x: {"q": torch.zeros(N, T, H * D + 4, dtype=torch.bfloat16)[..., : H * D].unflatten(-1, (H, D))},
        r"q.stride\(1\) = 516 must be a multiple of 8",
    ),
    (lambda x: {"g": x["g"].half()}, "g must be torch.bfloat16"),
    (lambda x: {"beta": x["beta"][..., None]}, r"beta must have shape \[3, 2, 4\]"),
    (
        lambda x: {"beta": torch.zeros(N, H, T, dtype=torch.bfloat16).transpose(1, 2)},
        "beta must have unit stride along H",
    ),
    (lambda x: {"A_log": x["A_log"].double()}, "A_log must be torch.float32"),
    (lambda x: {"A_log": torch.zeros(2 * H)[::2]}, "A_log must be contiguous"),
    (lambda x: {"dt_bias": x["dt_bias"][:, :64].contiguous()}, r"dt_bias must have shape \[4, 128\]"),
    (lambda x: {"lower_bound": 0.0}, r"lower_bound must be in \[-5, 0\), got 0.0"),
    (lambda x: {"lower_bound": -6.0}, r"lower_bound must be in \[-5, 0\)"),
    (lambda x: {"scale": float("inf")}, "scale must be a finite number"),
    (lambda x: {"state_layout": "vkv"}, "state_layout must be one of"),
    (lambda x: {"num_tokens": 3}, r"num_tokens = 3 but q has T = 2"),
    (lambda x: {"num_tokens": 9}, r"num_tokens must be an int in \[1, 8\]"),
    (lambda x: {"num_tokens": 2.0}, r"num_tokens must be an int"),
    (
        lambda x: (
            {k: torch.zeros(1, 9, H, D, dtype=torch.bfloat16) for k in ("q", "k", "v", "g")}
            | {"beta": torch.zeros(1, 9, H, dtype=torch.bfloat16), "state_indices": torch.zeros(1, dtype=torch.int32)}
        ),
        "decode runs T = 1..8 tokens per sequence, got T = 9",
    ),
    (
        lambda x: {"state_pool": torch.zeros(N, H, D, D, dtype=torch.float16)},
        "state_pool must be torch.float32 or torch.bfloat16",
    ),
    (
        lambda x: {"state_pool": torch.zeros(N, H + 1, D, D)},
        r"state_pool must have shape \[slots >= 1, 4, 128, 128\] \(a pool\)",
    ),
    (lambda x: {"state_pool": torch.zeros(0, H, D, D)}, "slots >= 1"),
    (lambda x: {"state_pool": torch.zeros(N, H, D, D).transpose(2, 3)}, "state_pool must be contiguous within a slot"),
    (lambda x: {"state_pool": torch.zeros(H, N, D, D).transpose(0, 1)}, "state_pool must be contiguous within a slot"),
    (lambda x: {"state_pool": _padded_pool(2)}, "must be a multiple of 16 bytes"),
    (
        lambda x: {"state_pool": torch.zeros(4 * H * D * D + 4)[1 : 1 + 4 * H * D * D].view(4, H, D, D)},
        "state_pool must start on a 16-byte",
    ),
    (lambda x: {"state_indices": torch.tensor([0, 1, 2])}, "state_indices must be torch.int32"),
    (lambda x: {"state_indices": torch.tensor([0, 1], dtype=torch.int32)}, r"state_indices must have shape \[3\]"),
    (lambda x: {"state_indices": torch.zeros(6, dtype=torch.int32)[::2]}, "state_indices must be contiguous"),
    (
        lambda x: {"intermediate_states": torch.zeros(N, T, H, D, D, dtype=torch.bfloat16)},
        "intermediate_states must be torch.float32",
    ),
    (
        lambda x: {"intermediate_states": torch.zeros(N, T + 1, H, D, D)},
        r"intermediate_states must have shape \[3, 2, 4, 128, 128\]",
    ),
    (
        lambda x: {"intermediate_states": torch.zeros(N, H, T, D, D).transpose(1, 2)},
        "intermediate_states must be contiguous",
    ),
    (lambda x: {"intermediate_states": torch.zeros(1)}, r"intermediate_states must have shape"),
    (lambda x: {"out": torch.empty(N, T, H, D)}, "out must be torch.bfloat16"),
    (lambda x: {"out": x["q"]}, "out must not alias q"),
    (lambda x: {"out": x["g"]}, "out must not alias g"),
    (
        lambda x: {
            "out": x["state_pool"].view(-1)[: N * T * H * D].view(torch.bfloat16)[: N * T * H * D].view(N, T, H, D)
        },
        "out must not alias state_pool",
    ),
    (
        lambda x: {"out": torch.zeros(N, T, H, D + 8, dtype=torch.bfloat16)[..., :D]},
        "out must have unit stride along D and head stride 128",
    ),
    (lambda x: {"status": torch.zeros(1, 1, dtype=torch.float32)}, "status must be a one-element torch.int32 tensor"),
    (lambda x: {"status": torch.zeros(8, dtype=torch.int32)[1:2]}, "status must start on a 16-byte boundary"),
    (lambda x: {"beta_sigmoid": "no"}, "beta_sigmoid must be True or False, got 'no'"),
    (lambda x: {"qk_l2norm": 0}, "qk_l2norm must be True or False, got 0"),
    # vLLM's per-token slots: [N, T] state_indices and num_accepted.
    (
        lambda x: {"state_indices": torch.zeros(N, T + 1, dtype=torch.int32)},
        r"state_indices of two dims holds a pool slot per token: shape \[3, 2\]",
    ),
    (
        lambda x: {"state_indices": torch.zeros(N, 2 * T, dtype=torch.int32)[:, ::2]},
        r"state_indices \[N, T\] must be contiguous",
    ),
    (lambda x: {"state_indices": torch.zeros(N, T, dtype=torch.int64)}, "state_indices must be torch.int32"),
    (
        lambda x: {"num_accepted": torch.ones(N, dtype=torch.int32)},
        r"num_accepted picks the slot to read among a row of \[N, T\] state_indices",
    ),
    (
        lambda x: {
            "state_indices": torch.zeros(N, T, dtype=torch.int32),
            "intermediate_states": torch.zeros(N, T, H, D, D),
        },
        r"intermediate_states cannot be given with \[N, T\] state_indices",
    ),
    (
        lambda x: {
            "state_indices": torch.zeros(N, T, dtype=torch.int32),
            "num_accepted": torch.ones(N + 1, dtype=torch.int32),
        },
        r"num_accepted must have shape \[3\]",
    ),
    (
        lambda x: {"state_indices": torch.zeros(N, T, dtype=torch.int32), "num_accepted": torch.ones(N)},
        "num_accepted must be torch.int32",
    ),
]


@pytest.mark.parametrize("rule", range(len(RULES)))
def test_rule(args, rule):
    overrides, message = RULES[rule]
    with pytest.raises(KDAInputError, match=message):
        _call(args, **overrides(args))


def test_intermediate_states_must_not_overlap_the_pool(args):
    pool = torch.zeros(N * T + 1, H, D, D)
    with pytest.raises(KDAInputError, match="intermediate_states must not overlap state_pool"):
        _call(args, state_pool=pool, intermediate_states=pool[1:].view(N, T, H, D, D))


def test_token_major_input_needs_whole_sequences(args):
    flat = {k: args[k].flatten(0, 1) for k in ("q", "k", "v", "g", "beta")}
    with pytest.raises(KDAInputError, match="q has 6 token rows, not a multiple of num_tokens = 4"):
        _call({**args, **flat}, num_tokens=4)
    with pytest.raises(KDAInputError, match="inputs are on cpu"):
        _call({**args, **flat}, num_tokens=T)


def test_rejection_writes_nothing(args):
    out = torch.full((N, T, H, D), 7.0, dtype=torch.bfloat16)
    inter = torch.full((N, T, H, D, D), 3.0)
    pool = torch.full((N + 2, H, D, D), 5.0)
    for bad in ({"lower_bound": 1.0}, {}):  # a value rule, then the device rule
        with pytest.raises(KDAInputError):
            _call(args, out=out, intermediate_states=inter, state_pool=pool, **bad)
        assert bool((out == 7.0).all()) and bool((inter == 3.0).all()) and bool((pool == 5.0).all())


def test_every_pick_is_a_built_kernel():
    from cula_aot.ops.decode import pick_variant, variant_spec
    from cula_aot.specs import GATES, DecodeChunkSpec, DecodeSpec, default_specs

    built = {s.name for s in default_specs() if isinstance(s, (DecodeSpec, DecodeChunkSpec))}
    for n in (1, 3, 16, 64, 100, 256, 1024, 4096):
        for heads in (1, 4, 8, 64, 128):
            for tokens in (1, 2, 4, 8):
                for bf16 in (False, True):
                    for layout in ("vk", "kv"):
                        for inter in (False, True):
                            for gate in GATES:
                                variant = pick_variant(n, heads, tokens, bf16, layout, inter, gate)
                                assert variant_spec(variant, bf16, layout, gate).name in built
    # latency-bound sizes get the most CTAs; large bf16 T > 1 calls stream four items per CTA
    assert pick_variant(1, 4, 1, False) == (32, 1) and pick_variant(1024, 64, 4, True, "kv") == (32, 4)
    assert pick_variant(1024, 64, 1, True) == (32, 2) and pick_variant(8, 64, 4, True, "kv") == (32, 2)
    assert pick_variant(16, 64, 4, True, "vk", True) == (32, 4)
    assert pick_variant(1024, 64, 4, False) == (32, 1) and pick_variant(1024, 64, 1, False) == (32, 2)
    # 2–4 tokens on a bf16 "vk" pool without intermediates: the tensor-core chunk kernel
    for tokens in (2, 3, 4):
        assert pick_variant(16, 64, tokens, True) == ("chunk", 2, 4)
    assert pick_variant(4, 64, 4, True) == ("chunk", 4, 1) and pick_variant(256, 64, 4, True) == ("chunk", 4, 2)
    assert pick_variant(16, 64, 5, True)[0] != "chunk" and pick_variant(16, 64, 4, False)[0] != "chunk"
    # every gate has the chunk kernel (the unbounded ones without the deferred decay)
    assert all(pick_variant(16, 64, 3, True, gate=gate) == ("chunk", 2, 4) for gate in GATES)


def test_more_sequences_than_the_grid_holds_is_refused(args):
    q = torch.zeros(65536, T, H, D, dtype=torch.bfloat16)
    with pytest.raises(KDAInputError, match="q has 65536 sequences; one call runs at most 65535: split the batch"):
        _call(args, q=q)
