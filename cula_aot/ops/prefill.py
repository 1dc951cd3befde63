"""The serial KDA prefill: validation, K1 then K2 on the current stream (SPEC §5, §6).

Validation runs entirely before the first launch, so a rejected call writes nothing.  Varlen
``cu_seqlens`` values are checked on the host: from ``cu_seqlens_cpu`` when given (no GPU→CPU
sync), else from ``cu_seqlens`` itself (a CPU tensor costs nothing; a CUDA tensor is copied to the
host once, which synchronises — pass ``cu_seqlens_cpu`` to keep the serial path sync-free).
"""

import torch

from ..layout import (
    FLAG_FINAL_STATE,
    FLAG_IDENTITY_INIT,
    FLAG_INITIAL_STATE,
    FLAG_NO_OUTPUT,
    FLAG_ZERO_V,
    SEG_FINAL_INDEX,
    SEG_FIRST_SLOT,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_INIT_INDEX,
    SEG_SEQ,
    SEG_TOKENS,
    SEGMENT_FIELDS,
    D,
)
from ..runtime.loader import default_loader
from ..specs import K2_DEFAULT_V_BLOCK, K2_SEGMENTED_V_BLOCK, K1Spec, K2Spec, MergeSpec
from . import cp_plan
from .prepare import DEFAULT_SCALE, launch_prepare, workspace_values
from .workspace import TABLE_STAGING

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
             cu_seqlens_cpu, state_layout, out, final_state, intracard_cp="auto"):
    """Check every argument; returns (batch, seq_len, heads, num_seqs, scale, host cu_seqlens)."""
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

    # Identity tests: 0 == False and 1 == True, but 0 is no s_split.
    if not (intracard_cp is True or intracard_cp is False or (isinstance(intracard_cp, str) and intracard_cp == "auto")
            or (type(intracard_cp) is int and intracard_cp >= 1)):
        _fail(f"intracard_cp must be 'auto', True, False or an int s_split >= 1, got {intracard_cp!r}")

    num_seqs = batch
    host_cu = None
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
        host_cu = _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, seq_len)
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
    return batch, seq_len, heads, num_seqs, scale, host_cu


def _resolve_split(intracard_cp, batch, seq_len, heads, host_cu, device) -> int:
    if intracard_cp is False:
        return 1
    if type(intracard_cp) is int:
        return intracard_cp
    lengths = [seq_len] * batch if host_cu is None else [b - a for a, b in zip(host_cu, host_cu[1:])]
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    s_split = cp_plan.auto_split(lengths, heads, sm_count, D // K2_SEGMENTED_V_BLOCK)
    return max(s_split, 2) if intracard_cp is True else s_split


def _segment_row(seg, init_index, final_index, flags) -> list[int]:
    row = [0] * SEGMENT_FIELDS
    row[SEG_SEQ], row[SEG_FIRST_TOKEN], row[SEG_FIRST_SLOT] = seg.seq, seg.first_token, seg.first_slot
    row[SEG_TOKENS], row[SEG_INIT_INDEX], row[SEG_FINAL_INDEX], row[SEG_FLAGS] = (
        seg.num_tokens, init_index, final_index, flags)
    return row


def _segment_tables(segments, want_final):
    """Rows of the pre_scan jobs and of the segmented recurrence, and each sequence's segment
    range.  Pre_scan job 2i (2i + 1) writes M_i (B_i) of segment i; segment i of the recurrence
    starts from carries[i]."""
    transition = FLAG_IDENTITY_INIT | FLAG_ZERO_V | FLAG_NO_OUTPUT | FLAG_FINAL_STATE
    prescan_rows, main_rows, bounds = [], [], [0]
    for seq_segments in segments:
        for n, seg in enumerate(seq_segments):
            index = len(main_rows)
            last = n + 1 == len(seq_segments)
            if not last:
                prescan_rows.append(_segment_row(seg, -1, 2 * index, transition))
                prescan_rows.append(_segment_row(seg, -1, 2 * index + 1, FLAG_NO_OUTPUT | FLAG_FINAL_STATE))
            final = FLAG_FINAL_STATE if (last and want_final) else 0
            main_rows.append(_segment_row(seg, index, seg.seq, FLAG_INITIAL_STATE | final))
        bounds.append(len(main_rows))
    return prescan_rows, main_rows, bounds


def _to_device(values: list[int], device, stream: torch.cuda.Stream) -> torch.Tensor:
    """A small int32 host table on the device without a GPU→CPU sync (stream-ordered copy from
    pinned memory: the per-stream staging buffer, or a fresh pinned tensor under graph capture,
    where a replay must keep reading this call's values)."""
    host = torch.tensor(values, dtype=torch.int32)
    if torch.cuda.is_current_stream_capturing():
        return host.pin_memory().to(device, non_blocking=True)
    return TABLE_STAGING.upload(host, device, stream)


def prefill(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale=None, initial_state=None,
            output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, state_layout="vk",
            out=None, final_state=None, intracard_cp="auto", v_block=K2_DEFAULT_V_BLOCK):
    """K1 then K2 (serial), or K1, pre_scan, merge and segmented K2 (intracard CP), all on
    ``torch.cuda.current_stream(q.device)``."""
    batch, seq_len, heads, num_seqs, scale, host_cu = validate(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        state_layout=state_layout, out=out, final_state=final_state, intracard_cp=intracard_cp)
    device = q.device
    varlen = cu_seqlens is not None
    s_split = _resolve_split(intracard_cp, batch, seq_len, heads, host_cu, device)
    segments = cp_plan.plan(cp_plan.sequences(batch, seq_len, host_cu), s_split) if s_split > 1 else None
    if segments is not None and all(len(s) == 1 for s in segments):
        segments = None  # nothing long enough to split: the serial path is the same work, faster
    loader = default_loader()
    # Resolve every kernel first: an unbuilt head count fails before anything launches.
    k1 = loader.get(device, K1Spec(heads=heads, varlen=varlen))
    if segments is None:
        k2 = loader.get(device, K2Spec(heads=heads, varlen=varlen, v_block=v_block))
    else:
        k2 = loader.get(device, K2Spec(heads=heads, varlen=True, v_block=K2_SEGMENTED_V_BLOCK, segmented=True))
        merge = loader.get(device, MergeSpec(heads=heads))

    if out is None:
        out = torch.empty_like(v)
    want_final = output_final_state or final_state is not None
    if want_final and final_state is None:
        final_state = torch.empty(num_seqs, heads, D, D, dtype=torch.float32, device=device)
    torch_stream = torch.cuda.current_stream(device)  # read once: every launch goes here
    stream = torch_stream.cuda_stream
    _, common, _cu32 = workspace_values(device, batch, seq_len, heads, cu_seqlens, stream)
    launch_prepare(k1, q, k, g, beta, A_log, dt_bias, lower_bound, scale, common, stream)
    # [N, H, V, K] ("vk", the public default) or [N, H, K, V]: S[k, v] at k·sk + v·sv.
    stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
    user_init = initial_state.data_ptr() if initial_state is not None else 0
    user_final = final_state.data_ptr() if want_final else 0
    init_flag = FLAG_INITIAL_STATE if initial_state is not None else 0
    k2_common = {**common, "v": v.data_ptr(), "out": out.data_ptr(), "segments": 0,
                 "init_stride_k": stride_k, "init_stride_v": stride_v,
                 "final_stride_k": stride_k, "final_stride_v": stride_v}
    if segments is None:
        k2.launch({**k2_common, "initial_state": user_init, "final_state": user_final,
                   "flags": init_flag | (FLAG_FINAL_STATE if want_final else 0)}, stream)
        return out, (final_state if want_final else None)

    prescan_rows, main_rows, bounds = _segment_tables(segments, want_final)
    n_segments = len(main_rows)
    # One upload: the segment rows, then the per-sequence bounds (at a multiple of 32 bytes).
    n_rows = len(prescan_rows) + len(main_rows)
    uploaded = _to_device([v for row in prescan_rows + main_rows for v in row] + bounds, device, torch_stream)
    table = uploaded[: n_rows * SEGMENT_FIELDS].view(n_rows, SEGMENT_FIELDS)
    seq_segments = uploaded[n_rows * SEGMENT_FIELDS :]
    # Transition pairs (M_i, B_i) and merged start states, fp32 [K, V] row-major per head.
    prescan = torch.empty(2 * n_segments, heads, D, D, dtype=torch.float32, device=device)
    carries = torch.empty(n_segments, heads, D, D, dtype=torch.float32, device=device)
    row_bytes = table.element_size() * table.shape[1]
    k2.launch({**k2_common, "segments": table.data_ptr(), "num_seqs": len(prescan_rows),
               "initial_state": 0, "final_state": prescan.data_ptr(),
               "final_stride_k": D, "final_stride_v": 1, "flags": 0}, stream)
    merge.launch({"initial_state": user_init, "prescan": prescan.data_ptr(), "carries": carries.data_ptr(),
                  "seq_segments": seq_segments.data_ptr(), "num_seqs": num_seqs, "heads": heads,
                  "init_stride_k": stride_k, "init_stride_v": stride_v, "flags": init_flag}, stream)
    k2.launch({**k2_common, "segments": table.data_ptr() + row_bytes * len(prescan_rows),
               "num_seqs": n_segments, "initial_state": carries.data_ptr(), "final_state": user_final,
               "init_stride_k": D, "init_stride_v": 1, "flags": 0}, stream)
    return out, (final_state if want_final else None)
