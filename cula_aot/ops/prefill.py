"""The serial KDA prefill: validation, K1 then K2 on the current stream (SPEC §5, §6).

Validation runs entirely before the first launch, so a rejected call writes nothing.  Varlen
``cu_seqlens`` values are checked on the host: from ``cu_seqlens_cpu`` when given (no GPU→CPU
sync), else from ``cu_seqlens`` itself (a CPU tensor costs nothing; a CUDA tensor is copied to the
host once, which synchronises — pass ``cu_seqlens_cpu`` to keep the serial path sync-free).
"""

import torch

from ..layout import FLAG_FINAL_STATE, FLAG_INITIAL_STATE, D
from ..runtime.loader import default_loader
from ..specs import K2_DEFAULT_V_BLOCK
from .prepare import DEFAULT_SCALE, launch_prepare, plan_slots
from .workspace import ARENA

STATE_LAYOUTS = ("vk", "kv")


class KDAInputError(ValueError):
    """A kda_prefill argument is invalid; the message names it and the fix."""


def _fail(message: str):
    raise KDAInputError(message)


def _check_tensor(name, t, dtype, shape, device):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}; convert it with {name}.to({dtype})")
    if tuple(t.shape) != tuple(shape):
        _fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}; move all inputs to one CUDA device")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous; call {name}.contiguous()")


def _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens: int) -> list[int]:
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    values = [int(x) for x in source.tolist()]
    if cu_seqlens_cpu is not None and cu_seqlens.numel() != len(values):
        _fail(f"cu_seqlens_cpu has {len(values)} entries but cu_seqlens has {cu_seqlens.numel()}")
    if values[0] != 0:
        _fail(f"cu_seqlens must start at 0, got {values[0]}")
    for n, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            _fail(f"cu_seqlens must be non-decreasing: cu_seqlens[{n + 1}] = {b} < cu_seqlens[{n}] = {a}")
        if b == a:
            _fail(f"cu_seqlens describes an empty sequence {n} ({a}..{b}); drop empty sequences")
    if values[-1] != total_tokens:
        _fail(f"cu_seqlens must end at T = {total_tokens} (q.shape[1]), got {values[-1]}")
    return values


def validate(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
             cu_seqlens_cpu, state_layout, out, final_state):
    """Check every argument; returns (batch, seq_len, heads, num_seqs, scale)."""
    if not isinstance(q, torch.Tensor):
        _fail(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        _fail(f"q must be [B, T, H, {D}], got shape {list(q.shape)}")
    batch, seq_len, heads, dim = q.shape
    if dim != D:
        _fail(f"head dim must be {D} (cula_aot builds D = K = V = {D} only), got q.shape[-1] = {dim}")
    if seq_len == 0 or batch == 0 or heads == 0:
        _fail(f"q must have B, T, H > 0, got shape {list(q.shape)}")
    device = q.device
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_tensor(name, t, torch.bfloat16, (batch, seq_len, heads, D), device)
    _check_tensor("beta", beta, torch.bfloat16, (batch, seq_len, heads), device)
    _check_tensor("A_log", A_log, torch.float32, (heads,), device)
    _check_tensor("dt_bias", dt_bias, torch.float32, (heads, D), device)
    lower_bound = float(lower_bound)
    if not -5.0 <= lower_bound < 0.0:
        _fail(f"lower_bound must be in [-5, 0), got {lower_bound}")
    scale = DEFAULT_SCALE if scale is None else float(scale)
    if not (scale == scale and abs(scale) != float("inf")):
        _fail(f"scale must be a finite number, got {scale}")
    if state_layout not in STATE_LAYOUTS:
        _fail(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")

    num_seqs = batch
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail("cu_seqlens must be an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
        if cu_seqlens.device not in (device, torch.device("cpu")):
            _fail(f"cu_seqlens is on {cu_seqlens.device}; put it on {device} (or the CPU)")
        if batch != 1:
            _fail(f"varlen input (cu_seqlens) needs batch size 1, got B = {batch}; flatten to [1, total, H, {D}]")
        num_seqs = cu_seqlens.numel() - 1
        _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, seq_len)
    elif cu_seqlens_cpu is not None:
        _fail("cu_seqlens_cpu was given without cu_seqlens")

    state_shape = (num_seqs, heads, D, D)
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, torch.float32, state_shape, device)
    if final_state is not None:
        _check_tensor("final_state", final_state, torch.float32, state_shape, device)
    if out is not None:
        _check_tensor("out", out, torch.bfloat16, (batch, seq_len, heads, D), device)
    for name, t in (("out", out), ("final_state", final_state)):
        if t is not None and any(t.data_ptr() == x.data_ptr() for x in (q, k, v, g)):
            _fail(f"{name} must not alias an input tensor")
    # Last, so every shape/dtype/value rule above is also checked (and testable) on the CPU.
    if device.type != "cuda":
        _fail(f"inputs are on {device}: cula_aot runs on CUDA (sm_90a) devices only; move them with .cuda()")
    return batch, seq_len, heads, num_seqs, scale


def prefill(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale=None, initial_state=None,
            output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, state_layout="vk",
            out=None, final_state=None, v_block=K2_DEFAULT_V_BLOCK):
    """Serial prefill: K1 then K2 on ``torch.cuda.current_stream(q.device)``."""
    batch, seq_len, heads, num_seqs, scale = validate(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        state_layout=state_layout, out=out, final_state=final_state)
    device = q.device
    varlen = cu_seqlens is not None
    loader = default_loader()
    # Resolve both kernels first: an unbuilt head count fails before anything launches.
    k1 = loader.get(device, "k1_prepare", heads=heads, varlen=varlen)
    k2 = loader.get(device, "k2_recurrence", heads=heads, varlen=varlen, v_block=v_block)

    if out is None:
        out = torch.empty_like(v)
    want_final = output_final_state or final_state is not None
    if want_final and final_state is None:
        final_state = torch.empty(num_seqs, heads, D, D, dtype=torch.float32, device=device)
    cu32 = None
    if varlen:
        cu32 = cu_seqlens.to(device=device, dtype=torch.int32)

    total_slots = plan_slots(batch, seq_len, cu_seqlens)
    views = ARENA.carve(device, heads * total_slots)
    common = {
        "cu_seqlens": cu32.data_ptr() if varlen else 0,
        **{f"ws_{name}": view.data_ptr() for name, view in views.items()},
        "seq_len": seq_len, "num_seqs": num_seqs, "total_slots": total_slots, "heads": heads,
    }
    launch_prepare(k1, q, k, g, beta, A_log, dt_bias, lower_bound, scale, common, device)
    # [N, H, V, K] ("vk", the public default) or [N, H, K, V]: S[k, v] at k·sk + v·sv.
    stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
    k2.launch({
        **common,
        "v": v.data_ptr(), "out": out.data_ptr(),
        "initial_state": initial_state.data_ptr() if initial_state is not None else 0,
        "final_state": final_state.data_ptr() if want_final else 0,
        "state_stride_k": stride_k, "state_stride_v": stride_v,
        "flags": (FLAG_INITIAL_STATE if initial_state is not None else 0) | (FLAG_FINAL_STATE if want_final else 0),
    }, device)
    return out, (final_state if want_final else None)
