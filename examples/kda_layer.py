"""A KDA layer the way a vLLM/SGLang-style engine drives it: a recurrent-state pool, chunked
prefill that continues from cached state, padded batches replayed from a CUDA graph.

    PYTHONPATH=. python examples/kda_layer.py   # from a checkout; needs an sm_90a GPU and built kernels

The engine owns one pool per layer, ``[max_requests, H, V, K]``; each running request holds a
slot.  A prefill batch is a varlen batch: ``cu_seqlens`` on the device (no host copy, so the
call is sync-free and capturable), ``state_indices[n]`` = the slot of sequence n; the layer
reads each sequence's state from its slot and writes the new state back in place.  A padded
batch (fixed token and sequence counts, as a captured graph needs) puts its padding tokens in
a sequence whose index is -1: zero start, nothing written.

The script checks itself: two chunks continued through the pool equal one prefill of the whole
prompt, and a graph replay with new requests equals the eager call.
"""

import torch

import cula_aot
from cula_aot.reference import rel_rmse

HEADS = 8  # a tensor-parallel shard of the model's heads
D = 128


class KDALayer:
    """The attention part of one KDA layer over a state pool (projections left out)."""

    def __init__(self, max_requests: int, device="cuda", state_dtype=torch.float32, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.A_log = torch.log(torch.rand(HEADS, generator=gen, device=device) * 15 + 1)
        self.dt_bias = 0.1 * torch.randn(HEADS, D, generator=gen, device=device)
        self.lower_bound = -5.0
        self.pool = torch.zeros(max_requests, HEADS, D, D, device=device, dtype=state_dtype)

    def start(self, slots: torch.Tensor) -> None:
        """New requests begin from a zero state."""
        self.pool[slots] = 0

    def prefill(self, q, k, v, g, beta, cu_seqlens, state_indices, out=None):
        """One varlen prefill step: every sequence continues from (and updates) its pool slot."""
        o, _ = cula_aot.kda_prefill(
            q,
            k,
            v,
            g,
            beta,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.lower_bound,
            initial_state=self.pool,
            output_final_state=True,
            state_indices=state_indices,
            cu_seqlens=cu_seqlens,
            out=out,
        )
        return o


def fused_projection(tokens: int, gen):
    """q, k, v, g, beta as views of one projection output (engines slice, they do not copy)."""
    width = 4 * HEADS * D + HEADS
    proj = torch.randn(1, tokens, width, generator=gen, device="cuda").to(torch.bfloat16)
    views = [proj[..., i * HEADS * D : (i + 1) * HEADS * D].unflatten(-1, (HEADS, D)) for i in range(4)]
    return (*views, proj[..., 4 * HEADS * D :])


def cu_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def chunked_prefill_matches_one_shot():
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer = KDALayer(max_requests=16)
    prompt = [3000, 700]  # two requests, prefilled in two chunks each
    q, k, v, g, beta = fused_projection(sum(prompt), gen)
    slots = torch.tensor([11, 4], dtype=torch.int32, device="cuda")
    layer.start(slots)
    # One shot, for reference, on a private pool.
    reference = KDALayer(max_requests=16)
    o_ref = reference.prefill(q, k, v, g, beta, cu_of(prompt), slots)
    # Chunk 1: the first 2048 / 300 tokens; chunk 2: the rest, continuing from the pool.
    cut = [2048, 300]
    first = torch.cat([torch.arange(0, cut[0]), torch.arange(prompt[0], prompt[0] + cut[1])]).cuda()
    rest = torch.cat([torch.arange(cut[0], prompt[0]), torch.arange(prompt[0] + cut[1], sum(prompt))]).cuda()
    outs = []
    for index, lengths in ((first, cut), (rest, [p - c for p, c in zip(prompt, cut)])):
        chunk = [x[:, index] for x in (q, k, v, g, beta)]
        outs.append(layer.prefill(*chunk, cu_of(lengths), slots))
    o = torch.empty_like(o_ref)
    o[:, first], o[:, rest] = outs
    err_o, err_s = rel_rmse(o, o_ref), rel_rmse(layer.pool[slots], reference.pool[slots])
    print(f"chunked prefill vs one shot: o rel-RMSE {err_o:.1e}, state rel-RMSE {err_s:.1e}")
    assert err_o < 1e-2 and err_s < 1e-2


def graph_replay_of_a_padded_batch():
    """Capture one padded batch shape (4 sequences incl. padding, 1024 tokens) and replay it
    for new requests: new lengths, new slots, new values, no host sync."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    layer = KDALayer(max_requests=32)
    tokens = 1024
    static = list(fused_projection(tokens, gen))
    cu = cu_of([500, 300, 100, 124])
    indices = torch.tensor([0, 1, 2, -1], dtype=torch.int32, device="cuda")  # the last: padding
    out = torch.empty(1, tokens, HEADS, D, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.prefill(*static, cu, indices, out=out)  # warm-up: loads kernels, sizes the arena
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.prefill(*static, cu, indices, out=out)

    # A later step: three new requests in slots 7, 20, 3 (lengths 64 + 900 + 40), 20 padding tokens.
    fresh = fused_projection(tokens, gen)
    for s, f in zip(static, fresh):
        s.copy_(f)
    cu.copy_(cu_of([64, 900, 40, 20]))
    indices.copy_(torch.tensor([7, 20, 3, -1], dtype=torch.int32))
    layer.start(indices[:3])
    graph.replay()
    eager = KDALayer(max_requests=32)
    o_eager = eager.prefill(*fresh, cu, indices)
    torch.cuda.synchronize()
    assert torch.equal(out[:, :1004], o_eager[:, :1004]) and torch.equal(
        layer.pool[indices[:3]], eager.pool[indices[:3]]
    )
    print("graph replay of a padded batch with new requests equals the eager call")


if __name__ == "__main__":
    chunked_prefill_matches_one_shot()
    graph_replay_of_a_padded_batch()
    print("ok")
