"""kda_decode_layer's argument rules on the CPU: each bad argument is named with its fix before
anything launches (CPU tensors pass every rule but the device, the last one checked), the call's
signature keys packed and (q, k, v) forms apart, and a good call reaches the device check."""

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError
from cula_aot.ops.call import DecodeLayerCall

N, T, H, D, W = 3, 2, 2, 128, 4
C = H * D


def _args(**overrides):
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    args = dict(
        q=bf16(N, T, H, D),
        k=bf16(N, T, H, D),
        v=bf16(N, T, H, D),
        g=bf16(N, T, H, D),
        beta=bf16(N, T, H),
        A_log=torch.zeros(H),
        dt_bias=torch.zeros(H, D),
        lower_bound=-5.0,
        conv_weight=bf16(3 * C, 1, W),
        conv_state=bf16(N + 2, 3 * C, W - 1),
        out_gate=bf16(N, T, H, D),
        norm_weight=torch.ones(D, dtype=torch.bfloat16),
        state_pool=torch.zeros(N + 2, H, D, D),
        state_indices=torch.arange(N, dtype=torch.int32),
    )
    args.update(overrides)
    return args


def _call(**overrides):
    args = _args(**overrides)
    inputs = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return cula_aot.kda_decode_layer(*inputs, **args)


def test_a_good_call_reaches_the_device_check():
    with pytest.raises(KDAInputError, match="CUDA"):
        _call()
    caches = tuple(torch.zeros(N + 2, C, W, dtype=torch.bfloat16)[..., 1:] for _ in range(3))
    with pytest.raises(KDAInputError, match="CUDA"):  # fla's caches, as (q, k, v) views
        _call(conv_state=caches, conv_weight=tuple(torch.zeros(C, W) for _ in range(3)))
    with pytest.raises(KDAInputError, match="CUDA"):  # token-major conv state
        _call(conv_state=torch.zeros(N + 2, W - 1, 3 * C), conv_layout="token")


BAD = [
    (
        dict(state_indices=torch.arange(N * T, dtype=torch.int32).view(N, T)),
        r"kda_decode_layer takes state_indices \[N\] \(one pool slot per request\)",
    ),
    (dict(conv_weight=torch.zeros(3 * C, 3)), r"conv_weight \(q\) must have shape \[256, 4\]"),
    (dict(conv_weight=torch.zeros(2 * C, W)), r"conv_weight packed must have 3·H·128 = 768 channels"),
    (dict(conv_weight=torch.zeros(3 * C, W, dtype=torch.float16)), r"conv_weight \(q\) must be bf16 or fp32"),
    (dict(conv_weight=torch.zeros(W, 3 * C).t()), r"conv_weight \(q\) must be contiguous"),
    (dict(conv_bias=torch.zeros(3 * C)), r"conv_bias \(q\) must be torch.bfloat16"),
    (dict(conv_state=torch.zeros(N, 3 * C, W - 1)), r"conv_state \(q\) must have shape \[5, 256, 3\]"),
    (dict(conv_state=torch.zeros(N + 2, 3 * C, W)), r"conv_state \(q\) must have shape"),
    (dict(conv_layout="channels"), "conv_layout must be one of"),
    (
        dict(conv_state=(torch.zeros(N + 2, C, 3), torch.zeros(N + 2, C, 3), torch.zeros(N + 2, C, 3).double())),
        r"conv_state \(v\) must be bf16 or fp32",
    ),
    (
        dict(conv_state=(torch.zeros(N + 2, C, 3), torch.zeros(N + 2, C, 3), torch.zeros(N + 2, 3, C).transpose(1, 2))),
        "must share one dtype and strides",
    ),
    (dict(out_gate=torch.zeros(N, T, H, D)), "out_gate must be torch.bfloat16"),
    (dict(out_gate=torch.zeros(N, T, H + 1, D, dtype=torch.bfloat16)), "out_gate must have shape"),
    (dict(norm_weight=torch.ones(D + 1)), r"norm_weight must have shape \[128\]"),
    (dict(norm_weight=torch.ones(D, dtype=torch.int32)), "norm_weight must be a bf16 or fp32 tensor"),
    (dict(norm_eps=0.0), r"norm_eps must be in \(0, 1\)"),
    (dict(state_indices=torch.arange(N)), "state_indices must be torch.int32"),
    (dict(lower_bound=None), "gate='safe' needs lower_bound"),
    (dict(verify=True), r"verify=True writes a draft: pass drafts="),
    (dict(verify=1), "verify must be True or False"),
    (dict(num_accepted=torch.zeros(N, dtype=torch.int32)), "num_accepted commits a pending draft"),
    (dict(drafts=cula_aot.draft_buffers(N + 2, H)), "drafts needs num_accepted"),
    (
        dict(drafts=cula_aot.draft_buffers(N + 1, H), num_accepted=torch.zeros(N, dtype=torch.int32)),
        r"drafts.records must have shape \[5, 2, 8, 2, 6, 128\]",
    ),
    (
        dict(drafts=cula_aot.draft_buffers(N + 2, H), num_accepted=torch.zeros(N + 1, dtype=torch.int32)),
        r"num_accepted must have shape \[3\]",
    ),
    (dict(drafts=(torch.zeros(1),), num_accepted=torch.zeros(N, dtype=torch.int32)), "drafts must be"),
    (
        dict(
            drafts=(cula_aot.draft_buffers(N + 2, H).records, torch.zeros(N + 2, dtype=torch.int32)),
            num_accepted=torch.zeros(N, dtype=torch.int32),
        ),
        r"drafts.marks must have shape \[5, 2\]",
    ),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_each_bad_argument_is_named(case):
    overrides, message = BAD[case]
    with pytest.raises(KDAInputError, match=message):
        _call(**overrides)


def test_what_the_layer_writes_may_not_alias():
    packed = torch.zeros(N + 2, 3 * C, W - 1, dtype=torch.bfloat16)
    out = packed.view(-1)[: N * T * H * D].view(N, T, H, D)
    with pytest.raises(KDAInputError, match=r"out must not alias conv_state \(q\)"):
        _call(conv_state=packed, out=out)
    buffer = torch.zeros((N + 2) * C * 3, dtype=torch.bfloat16)
    q = buffer[: N * T * H * D].view(N, T, H, D)
    states = (buffer.view(N + 2, C, 3), *(torch.zeros(N + 2, C, 3, dtype=torch.bfloat16) for _ in range(2)))
    with pytest.raises(KDAInputError, match=r"conv_state \(q\) must not alias q"):
        _call(q=q, conv_state=states)


def test_a_draft_call_reaches_the_device_check():
    drafts = cula_aot.draft_buffers(N + 2, H)
    accepted = torch.zeros(N, dtype=torch.int32)
    for verify in (False, True):
        with pytest.raises(KDAInputError, match="CUDA"):
            _call(drafts=drafts, num_accepted=accepted, verify=verify)
    out = drafts.records.view(-1)[: N * T * H * D].view(N, T, H, D)
    with pytest.raises(KDAInputError, match="out must not alias drafts.records"):
        _call(drafts=drafts, num_accepted=accepted, out=out)


def test_missing_layer_arguments_are_a_type_error():
    args = _args()
    del args["norm_weight"]
    with pytest.raises(TypeError, match=r"kda_decode_layer\(\) missing required argument.*norm_weight"):
        DecodeLayerCall.of(args)


def test_the_signature_tells_packed_from_tuple_forms():
    packed = DecodeLayerCall.of(_args())
    split = DecodeLayerCall.of(_args(conv_weight=tuple(torch.zeros(C, W) for _ in range(3))))
    assert hash(packed.signature()) is not None
    assert packed.signature() != split.signature()
    assert DecodeLayerCall.of(_args()).signature() == packed.signature()
