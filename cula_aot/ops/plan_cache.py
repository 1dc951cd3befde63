"""The plan caches: the prefill's (``PlanCache``: launch plans by call, the cache owning every
key) and decode's and the fused layer's (``SignaturePlans``: by signature alone; ``LaunchPlans``
adds what each plan's checks gave an eager call, by its arguments as given, and ``CheckedPlan``
the plans' side of it).

A call's ``PrefillCall.signature`` (shapes, strides, dtypes, devices and options) finds the plan
its first call built.  Where that plan's choice turned on the call's host lengths
(``paths.Path``: a split planned per call, the fused choice's equal tile counts, a checkpoint
twin's elision), ``find`` reads this call's lengths and looks up the plan they pick under a key
that adds them; ``keep`` files a new plan under every key that should find it.
"""

import torch

from ..runtime.loader import raw_stream
from .call import PrefillCall
from .checks import read_host_cu
from .paths import equal_tile_counts, longest, resolve_split

PLAN_LIMIT = 256  # plans kept; cleared when full (a serving loop reuses a few)


class SignaturePlans:
    """Plans by ``call.signature()`` alone, each built by ``make(call)`` at the signature's first
    call.  The last (signature, plan) found is compared before the dict is hashed: a model's layers
    repeat one signature per step, and comparing costs half of hashing."""

    def __init__(self, make, limit: int = PLAN_LIMIT):
        self.make, self.limit = make, limit
        self._plans: dict = {}
        self._last = (None, None)

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, call):
        try:
            key = call.signature()
            last_key, plan = self._last
            if key != last_key:
                plan = self._plans.get(key)
                if plan is not None:
                    self._last = key, plan
        except (AttributeError, TypeError):  # not tensors, or unhashable options: validation names it
            key = plan = None
        if plan is None:
            plan = self.make(call)
            if key is not None:
                if len(self._plans) >= self.limit:
                    self._plans.clear()
                self._plans[key] = plan
                self._last = key, plan
        return plan


class LaunchPlans(SignaturePlans):
    """``SignaturePlans`` and, for the eager entry (``ops.decode.launch``,
    ``ops.decode_layer.launch``), each call's (plan, the plan's ``check`` of it) by a key of the
    call's arguments as given (every tensor's layout and address, every option): a repeat binds
    nothing.  The last key found is compared before the dict is hashed."""

    def __init__(self, make):
        super().__init__(make)
        self.launches: dict = {}
        self.last_launch = (None, None)

    def found(self, key):
        """(plan, checked) kept for the arguments' ``key``, or None."""
        last_key, found = self.last_launch
        if key != last_key:
            found = self.launches.get(key)
            if found is not None:
                self.last_launch = key, found
        return found

    def check(self, call, key):
        """The plan of ``call`` and its ``check`` of it, kept under ``key`` unless None (arguments
        a key cannot read, or that binding had to convert)."""
        plan = self.get(call)
        found = plan, plan.check(call)
        if key is not None:
            if len(self.launches) >= self.limit:
                self.launches.clear()
            self.launches[key] = found
            self.last_launch = key, found
        return found


class CheckedPlan:
    """A token-step plan's (decode's, the layer's) side of ``LaunchPlans``: per combination of a
    call's addresses and scalars, the per-call values its checks gave and, when the call gives
    ``out``, the packed parameter buffer, in its ``checked`` dict.  A plan sets ``checked``,
    ``out_shape``, ``flat``, ``num_seqs``, ``template``, ``device`` and ``OUT`` (out's index among
    its per-call values)."""

    OUT: int

    def keep(self, key: tuple, values: tuple) -> tuple:
        """(values, their parameter buffer, or None where the call allocates out), kept under
        ``key``: a call that gives out repeats its whole buffer, packed once."""
        checked = values, self.template.pack(values) if values[self.OUT] and self.num_seqs else None
        if len(self.checked) >= PLAN_LIMIT:
            self.checked.clear()
        self.checked[key] = checked
        return checked

    def launch_checked(self, checked: tuple, out):
        """Launch a checked call's (per-call values, parameter buffer: None where the call
        allocates ``out``), ``out`` allocated when None.  Returns ``out`` as the caller shaped q (token-major input: token-major output)."""
        values, packed = checked
        if out is None:
            out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=self.device)
            values = (*values[: self.OUT], out.data_ptr(), *values[self.OUT + 1 :])
        result = out.flatten(0, 1) if self.flat else out
        if self.num_seqs:
            if packed is None:
                packed = self.template.pack(values)
            self.template.launch_buffer(packed, raw_stream(self.device))
        return result


class PlanCache:
    def __init__(self, limit: int = PLAN_LIMIT):
        self.limit = limit
        self._plans: dict = {}

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list:
        return list(self._plans.values())

    def clear(self) -> None:
        """Forget every plan: the next call of each signature plans again (a benchmark that
        changes a planning constant between calls)."""
        self._plans.clear()

    @staticmethod
    def key(call: PrefillCall):
        """The signature key of ``call``, or None when an argument is not a tensor (validation
        names it)."""
        try:
            return call.signature()
        except AttributeError:
            return None

    def find(self, call: PrefillCall, key) -> tuple:
        """(the cached plan for ``call``, or None; the host cu_seqlens values read to choose it,
        checked when the signature checks them, or None)."""
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option: validation names it
            return None, None
        if plan is None:
            return None, None
        if plan.split == 1 and plan.lengths_uniform is None and plan.checkpoint_reach is None:
            return plan, None
        c = plan.c
        host_cu = read_host_cu(call.cu_seqlens, call.cu_seqlens_cpu, c.seqlens_checked, c.seq_len)
        if plan.split is None:
            s_split = resolve_split(
                call.intracard_cp, c.batch, c.seq_len, c.heads, call.cu_seqlens, host_cu, plan.device
            )
        else:
            s_split = plan.split
        if s_split > 1:
            return self._plans.get(_cp_key(key, host_cu, s_split)), host_cu
        if not plan.serial:
            return None, host_cu
        facts = _length_facts(plan, host_cu)
        if facts != plan.length_facts:
            return self._plans.get(_serial_key(key, *facts)), host_cu
        return plan, host_cu

    def keep(self, key, call: PrefillCall, plan) -> None:
        """File a new ``plan`` built for ``call`` (signature ``key``; None: not cached)."""
        if key is None:
            return
        if not plan.serial:
            # A CP plan is this signature's, these lengths' and this split's: a varlen call re-plans
            # its split from its lengths, a fixed-length one has them in the signature.
            self._remember(_cp_key(key, plan.host_cu, plan.s_split), plan)
            if key not in self._plans:  # the signature's first plan: it reads later calls' lengths
                self._remember(key, plan)
            return
        # Under "auto" with host lengths (split None) the plan re-plans each call (cheaply) and is
        # kept while serial; True or an s_split with host lengths keeps no serial plan.
        if plan.split == 1 or call.intracard_cp == "auto":
            self._remember(key, plan)
            if plan.length_facts != (None, None):  # a later call with other kinds of lengths finds its own
                self._remember(_serial_key(key, *plan.length_facts), plan)

    def _remember(self, key, plan) -> None:
        if len(self._plans) >= self.limit:
            self._plans.clear()
        self._plans[key] = plan


def _serial_key(key, lengths_uniform, checkpoints_reached) -> tuple:
    """The key of a serial plan chosen for host lengths: with (or without) equal tile counts,
    reaching a checkpoint (or not); None where the plan's choice does not turn on that."""
    return key, "serial", lengths_uniform, checkpoints_reached


def _cp_key(key, host_cu, s_split) -> tuple:
    """A CP plan's key: the signature, the host cu_seqlens (None: fixed length) and the split."""
    return key, None if host_cu is None else tuple(host_cu), s_split


def _length_facts(plan, host_cu) -> tuple:
    """What a serial plan's choice turned on, for a call's host lengths: (equal tile counts,
    checkpoint reached), None where the plan's choice does not turn on it."""
    uniform = None if plan.lengths_uniform is None else equal_tile_counts(host_cu)
    reached = None if plan.checkpoint_reach is None else longest(host_cu) >= plan.checkpoint_reach[0]
    return uniform, reached


PLANS = PlanCache()
