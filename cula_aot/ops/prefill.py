"""The KDA prefill entry point (docs/CONTRACT.md §5, §6, §9): ``run`` takes a ``PrefillCall``,
launches the plan the cache holds for it (``plan_cache``), or validates it (``prefill_checks``),
takes the path ``paths.choose_path`` names and builds that path's plan (``prefill_plans``), and
launches it on the current stream.

Validation runs entirely before the first launch, so a rejected call writes nothing.  The serial
path never reads a device tensor on the host: grids come from shapes (``layout.varlen_total_slots``)
and cu_seqlens values are checked on the host only when that is free (``cu_seqlens_cpu``, or a CPU
cu_seqlens) or asked for (``check_seqlens="host"``, a sync).
"""

from ..runtime.loader import default_loader
from . import plan_cache
from .call import PrefillCall
from .checks import KDAInputError  # noqa: F401 (re-exported)
from .paths import choose_path
from .prefill_checks import validate
from .prefill_plans import make_plan


def run(call: PrefillCall):
    """One prefill call on ``torch.cuda.current_stream(q.device)``: ``(o, final_state or None)``.
    A call signature seen before skips validation (its rules depend on nothing else) and launches
    from its cached plan; a new one is validated, planned and cached."""
    cache = plan_cache.PLANS
    key = cache.key(call)
    plan, host_cu = cache.find(call, key)
    if plan is None:
        c = validate(call)
        device = call.inputs.q.device
        plan = make_plan(call, c, choose_path(call, c, device), default_loader(), device)
        cache.keep(key, call, plan)
        host_cu = c.host_cu
    return plan.run(call, host_cu)


def prefill(q, k, v, g, beta, **options):
    """``run`` of the call ``PrefillCall.build`` makes of ``kda_prefill``'s arguments, and of the
    path overrides ``v_block`` (V columns per serial K2 CTA: 16, 32 or 64, as built; None picks
    from the grid, ``specs.auto_v_block``) and ``fused`` (True: the fused kernel; False: K1 then
    K2; None: ``specs.auto_fused`` picks, and a given ``v_block`` means K1 then K2)."""
    return run(PrefillCall.build(q, k, v, g, beta, **options))
