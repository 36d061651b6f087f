"""The gradient reducer: bucketed, asynchronous gradient synchronisation, once per step.

Under the dual-layout convention (``autopar.codegen.collectives``) a parameter stored replicated
over some mesh axes ends backward with a *pending sum* there: each rank holds a part and the true
gradient is their sum. The reducer turns those parts into the true gradient the way DDP's reducer
and FSDP2 do, with few, large, overlapped collectives:

    forward     the program reads each synchronised parameter through a *tap* (a leaf of its
                own per forward, viewing the parameter), so that backward hands the reducer the
                parameter's local gradient as soon as it is complete, not into ``.grad``;
    backward    each tap adds its gradient into its bucket's flat buffer; a bucket whose every
                parameter has reported launches its collective asynchronously at once (buckets
                launch in bucket order, so every rank issues the same collectives in the same
                order); a callback queued on the autograd engine launches what is left and waits
                for everything once, at the end of backward (under ``deferred_waits()``, a
                pipeline's, it only launches: ``synchronize()`` waits after the schedule);
    finish      the summed (all_reduce) or summed-and-split (reduce_scatter, ZeRO-2) bucket is
                added into each parameter's ``.grad`` (or becomes it, as views of the bucket).

An all-reduce bucket keeps its flat buffer from step to step, as DDP does (the ``.grad`` of its
parameters are views of it); while a ``.grad`` still views it (an optimizer that does not set
gradients to None), the next backward takes a new one.

Buckets hold parameters of one (collective, mesh axes, dtype, device), in the reverse of the order
the forward first reads them (the order backward finishes their gradients): a small first bucket
(``first_bucket_bytes``) so communication starts early, then ``bucket_bytes`` each.

Gradient accumulation: parts are accumulated in the buckets, not in ``.grad``. Backwards run
inside ``no_sync()`` (decided when the forward runs, as in DDP) only accumulate; the next backward
outside it synchronises the sum of every part once. ``.grad`` only ever holds true gradients, so
several synchronised backwards in a row also add up exactly. Parts still pending when an optimizer
steps are synchronised first (a global optimizer step pre-hook), so a loop that forgets to leave
``no_sync()`` before ``step()`` is slower, never wrong. Every rank must run the same program with
the same ``no_sync()`` usage (as with DDP): the collectives are matched by order.

ZeRO-2 (``sync.split``): the optimizer's parameter is this rank's chunk of the
storage shard along dim 0 (``ceil(d0 / n)`` rows, the last chunks shorter or empty); the program
reads the whole storage shard, a working copy the reducer all-gathers (bucketed) before a forward
whenever a chunk changed since the last gather (the optimizer stepped, a state dict was loaded),
through buffers made for that gather. Its gradient is reduce-scattered into the chunk's ``.grad``;
the whole bucket of gradients lives from its first part until its scatter is done, and at most
``SCATTERS_IN_FLIGHT`` scatters are (the oldest is finished before another starts). What stays
from step to step: the chunk, its gradient and states, and the working copy.

Mixed precision (``ir.precision.MixedPrecision``): the parameters are the fp32 masters and the
program reads working-dtype copies of them through the taps: parts reach the buckets in the
working dtype and add up in the masters' dtype there; a bucket's collective sums in the policy's
``reduce_dtype`` (its ``wire`` dtype: the buffer is cast before into a wire buffer an all-reduce
bucket keeps from step to step, the sum cast back once after), and a ZeRO-2 working copy
is kept and gathered in the working dtype (the masters' chunks cast into it): half the bytes of
gathering masters, as Megatron's distributed optimizer and FSDP2 gather bf16 parameters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

# One source for the bucket sizes: the cost model prices these buckets.
from autopar.record.buckets import DEFAULT_BUCKET_BYTES
from autopar.record.buckets import FIRST_BUCKET_BYTES as DEFAULT_FIRST_BUCKET_BYTES
from autopar.record.buckets import SCATTERS_IN_FLIGHT, assign_buckets, zero2_pool_cap, zero2_saved_bytes
from autopar.errors import ConfigError
from autopar.record.grad_sync import GradSync

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(eq=False)
class SyncEntry:
    """One synchronised parameter.

    slot: its index in the program's state inputs; param: the ``nn.Parameter`` the optimizer sees;
    sync: the plan's ``GradSync``: summed whole (the parameter is the storage shard) or split
    (ZeRO-2: the parameter is a dim-0 chunk of the storage shard, ``full`` the working copy the
    program reads), by the collective ``sync.sum_by``, over ``sync.axes``; first_use: position of
    its first reader in the forward; wire_dtype: the dtype the collective sums in (a
    mixed-precision ``reduce_dtype``), None: the parameter's."""

    slot: int
    param: torch.nn.Parameter
    sync: GradSync
    first_use: int
    full: torch.Tensor | None = None
    wire_dtype: torch.dtype | None = None
    # set by the bucket
    offset: int = 0
    numel: int = 0  # elements in the flat buffer: the gradient's (summed whole), one chunk's (ZeRO-2)


def chunk_rows(d0: int, n: int) -> int:
    """Rows per ZeRO-2 chunk of a dim of size ``d0`` over ``n`` ranks (the last may be shorter)."""
    return max(1, math.ceil(d0 / n))


def chunk_of(full: torch.Tensor, index: int, n: int) -> torch.Tensor:
    """Rows of chunk ``index`` of ``full`` along dim 0 (a view; empty past the end)."""
    flat = full.reshape(1) if full.dim() == 0 else full
    c = chunk_rows(flat.shape[0], n)
    start = min(index * c, flat.shape[0])
    return flat.narrow(0, start, min(c, flat.shape[0] - start))


def storage_of(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, the same for every view of it, on every device (a meta
    tensor's ``data_ptr()`` is 0, and a dry run's program runs on meta tensors)."""
    return t.untyped_storage()._cdata


class _Pool:
    """Flat buffers that ZeRO-2 buckets use only while they are summed or gathered, kept for the
    next use. Made anew each time, their pages were faulted in again every step: on this 2-core
    VM's 4 gloo ranks a new 32 MiB buffer cost 15-30 ms, as much as the collective that fills it.
    The smallest free buffer that fits is lent first; the pool keeps at most ``cap_bytes`` free
    (``record.buckets.zero2_pool_cap``, as the memory model prices it), a buffer given back past
    that is freed."""

    def __init__(self, cap_bytes: int | None = None):
        self.cap_bytes = cap_bytes
        self._free: list[torch.Tensor] = []  # byte buffers
        self._lent: dict[int, torch.Tensor] = {}  # storage of a lent view -> its byte buffer

    def take(self, numel: int, dtype: torch.dtype, device, at_least: int = 0) -> torch.Tensor:
        """A flat buffer of ``numel`` ``dtype`` elements; one made new has ``at_least`` bytes (a
        bucket's whole buffer: the gather's smaller ones then serve its sum later)."""
        nbytes = max(1, numel * dtype.itemsize)
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes and b.device == device]
        if fits:
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            buf = torch.empty(max(nbytes, at_least), dtype=torch.uint8, device=device)
        view = buf[: numel * dtype.itemsize].view(dtype)
        self._lent[storage_of(view)] = buf
        return view

    def give(self, *views) -> None:
        """Return buffers lent by ``take`` (anything else is ignored)."""
        for v in views:
            if v is not None:
                buf = self._lent.pop(storage_of(v), None)
                if buf is not None and (self.cap_bytes is None
                                        or sum(b.numel() for b in self._free) + buf.numel() <= self.cap_bytes):
                    self._free.append(buf)

    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent.values())


class _Bucket:
    def __init__(self, index: int, handle, entries: list[SyncEntry], pool: _Pool | None = None):
        self.index, self.handle, self.entries = index, handle, entries
        # ZeRO-2 (each rank keeps its chunk of the sum) or not, and the collective that sums
        self.split, self.sum_by = entries[0].sync.split, entries[0].sync.sum_by
        self.pool = pool if pool is not None else _Pool()
        self.n = handle.size
        ref = entries[0].param
        self.dtype, self.device = ref.dtype, ref.device
        self.wire = entries[0].wire_dtype or ref.dtype  # parts add up in ``dtype``, the collective sums in ``wire``
        offset = 0
        for e in entries:
            shape = e.full.shape if self.split else e.param.shape
            if self.split:
                d0 = shape[0] if len(shape) else 1
                e.numel = chunk_rows(d0, self.n) * (math.prod(shape[1:]) if len(shape) > 1 else 1)
            else:
                e.numel = e.param.numel()
            e.offset = offset
            offset += e.numel
        self.numel = offset  # all_reduce: the buffer; reduce_scatter: one rank's chunk of it
        # The flat buffer's rows are indexed by torch group rank; row_of_shard[i]: the row of shard index i.
        self.row_of_shard = list(handle.pg_of_shard)
        self.identity = self.row_of_shard == list(range(self.n))
        self.accum: torch.Tensor | None = None  # parts summed since the last launch
        self.received: set[int] = set()  # slots of the entries that got a part since the last launch
        self._storage: torch.Tensor | None = None  # the flat buffer, kept from step to step
        self._wire_storage: torch.Tensor | None = None  # the buffer sent in the wire dtype, likewise
        self._wire_busy = False  # a flight of this bucket is using ``_wire_storage``
        self._storage_busy = False  # parts or a flight of this bucket are using ``_storage``
        self.fired = 0  # entries reported in the current backward
        self.slots = {e.slot for e in entries}
        self._versions: tuple | None = None  # ZeRO-2: chunk versions at the last gather

    # ---- gradients in --------------------------------------------------------------------------
    def add(self, grads) -> None:
        """Add one part per entry (None: no part). An entry's first part since the last launch is
        copied in (nothing to zero first); where parts come in the wire dtype (a casting policy's
        working dtype summed in it) the first parts go straight into the buffer the collective sends,
        and the bucket moves to a master-dtype buffer only when an entry gets a second part (then
        the parts add up there, as before): a step without accumulation neither zeroes, nor adds
        into, nor casts out of a master-dtype buffer."""
        parts = [(e, g) for e, g in zip(self.entries, grads) if g is not None]
        if not parts:
            return
        again = any(e.slot in self.received for e, _ in parts)
        if self.accum is None:
            in_wire = self.wire != self.dtype and all(g.dtype == self.wire for _, g in parts)
            self.accum = self._wire_buffer(self._flat_numel()) if in_wire else self._fresh_buffer()
        elif self.accum.dtype != self.dtype and (again or any(g.dtype != self.wire for _, g in parts)):
            # a second part (or one in another dtype): the sum needs the master dtype
            in_wire, self.accum = self.accum, self._fresh_buffer().copy_(self.accum)
            self.pool.give(in_wire)
            self._wire_busy = False  # left unsent; the launch casts the sum back into it
        for e, g in parts:
            view = self._view(self.accum, e)
            if e.slot in self.received:
                view.add_(self._layout(e, g))
            else:
                view.copy_(self._layout(e, g))
                self.received.add(e.slot)

    def _flat_numel(self) -> int:
        return self.numel * (self.n if self.split else 1)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer from the pool; one made new holds this bucket whole in the wire dtype."""
        return self.pool.take(numel, dtype, self.device, at_least=self._flat_numel() * self.wire.itemsize)

    def _fresh_buffer(self) -> torch.Tensor:
        """A flat buffer in the master dtype (not zeroed: entries are copied in first): the one of
        the last step when no ``.grad`` still views it (the usual ``zero_grad()`` sets them to
        None), else a new one. As DDP keeps its buckets: a new multi-MB buffer each step cost its
        page faults again (50-150 ms a step on 4 ranks of the 10M GPT, more than the all-reduce
        of it)."""
        buf = self._storage
        if buf is not None:
            key = storage_of(buf)
            if self._storage_busy or any(e.param.grad is not None and storage_of(e.param.grad) == key
                                         for e in self.entries):
                buf = None
        if buf is None:
            if self.split:  # ZeRO-2 keeps only its chunk: the whole buffer goes back after the scatter
                return self._take(self._flat_numel(), self.dtype)
            buf = self._storage = torch.empty(self._flat_numel(), dtype=self.dtype, device=self.device)
        self._storage_busy = True  # until the flight that sums it finishes
        return buf

    def _wire_buffer(self, numel: int) -> torch.Tensor:
        """The buffer a collective in another dtype sends. An all-reduce bucket keeps it from step to
        step as it keeps its sum (a new one each step paid its page faults again, as much as the
        bytes the narrower dtype saves; priced with the gradients), unless a flight of this bucket
        still uses it; a ZeRO-2 bucket's comes from the reducer's pool."""
        if self.split:
            return self._take(numel, self.wire)
        if self._wire_busy:
            return torch.empty(numel, dtype=self.wire, device=self.device)
        if self._wire_storage is None or self._wire_storage.numel() != numel:
            self._wire_storage = torch.empty(numel, dtype=self.wire, device=self.device)
        self._wire_busy = True
        return self._wire_storage

    def _view(self, buf: torch.Tensor, e: SyncEntry) -> torch.Tensor:
        if not self.split:
            return buf[e.offset: e.offset + e.numel].view(e.param.shape)
        return buf.view(self.n, self.numel)[:, e.offset: e.offset + e.numel]

    def _layout(self, e: SyncEntry, g: torch.Tensor) -> torch.Tensor:
        """A gradient as its place in the buffer expects it: (n, chunk) rows by group rank for
        reduce_scatter (padded to whole chunks), unchanged for all_reduce."""
        if not self.split:
            return g
        flat = g.reshape(1, -1) if g.dim() == 0 else g.reshape(g.shape[0], -1)
        rows = chunk_rows(flat.shape[0], self.n)
        if rows * self.n != flat.shape[0]:
            flat = torch.nn.functional.pad(flat, (0, 0, 0, rows * self.n - flat.shape[0]))
        pieces = flat.reshape(self.n, rows * flat.shape[1])
        return pieces if self.identity else pieces[torch.tensor(self.row_of_shard).argsort()]

    # ---- collectives ---------------------------------------------------------------------------
    def launch(self) -> _Flight:
        """Start this bucket's collective on its accumulated parts (cast to the wire dtype)."""
        buf, self.accum = self.accum, None
        received, self.received = self.received, set()
        for e in self.entries:  # every rank runs the same program: an entry without parts is zero everywhere
            if e.slot not in received:
                self._view(buf, e).zero_()
        pg = self.handle.pg
        if buf.dtype == self.wire:  # summed in the dtype the parts were added in (or went straight into)
            sent = buf
        else:
            sent = self._wire_buffer(buf.numel()).copy_(buf)
            self.pool.give(buf)  # (a ZeRO-2 bucket's: the pool lends it again)
        if self.split and self.sum_by != "all_reduce":
            got = None
            try:
                if self.sum_by == "all_to_all":  # every rank's parts of this rank's rows, summed at finish
                    got = self._take(sent.numel(), sent.dtype)
                    work = dist.all_to_all_single(got, sent, group=pg, async_op=True)
                    return _Flight(self, got, work, received, lent=(sent, got), parts=True)
                out = sent.new_empty(self.numel)
                return _Flight(self, out, _reduce_scatter_flat(out, sent, group=pg, async_op=True), received,
                               lent=(sent,))
            except (RuntimeError, NotImplementedError, ValueError) as err:
                if "support" not in str(err).lower() and "implement" not in str(err).lower():
                    raise
                self.pool.give(got)  # the backend lacks it: all-reduce the whole buffer below
        # an all-reduce; a ZeRO-2 bucket's finish keeps this rank's chunk of the sum, an all-reduce
        # bucket's sum goes back into the buffer its parts were added in
        home = None
        if not self.split and sent.dtype != self.dtype:
            home = buf if buf.dtype == self.dtype else self._fresh_buffer()
        return _Flight(self, sent, dist.all_reduce(sent, group=pg, async_op=True), received, home, lent=(sent,))

    def finish(self, flight: _Flight) -> None:
        """Add a finished collective's result into the ``.grad`` of the parameters that got parts
        (one no gradient reached keeps ``.grad`` None, as autograd leaves it: an optimizer then
        skips it, weight decay included), cast back from the wire dtype once. Every rank runs the
        same program, so all agree."""
        result, received = flight.result, flight.received
        self._wire_busy = self._storage_busy = False  # flights of a bucket finish in launch order
        if self.split and result.numel() != self.numel:  # a whole bucket's rows
            rows = result.view(self.n, self.numel)
            if flight.parts:  # every rank's part of this rank's rows (all-to-all): summed in the master dtype,
                # row by row (a reduction over dim 0 that casts bf16 ran 2.7x slower than these adds)
                result = rows[0].to(self.dtype, copy=True)
                for row in rows[1:]:
                    result.add_(row)
            else:  # all-reduced: this rank's row of the sum
                result = rows[self.row_of_shard[self.handle.index]]
                if result.dtype == self.dtype:
                    result = result.clone()  # the chunk alone: the bucket goes back to the pool
        if result.dtype != self.dtype:
            # an all-reduce's sum goes back into the buffer its parts were added in (kept from
            # step to step); a scatter's chunk is small and new
            result = flight.home.copy_(result) if flight.home is not None else result.to(self.dtype)
        for e in self.entries:
            if e.slot not in received:
                continue
            if not self.split:
                g = result[e.offset: e.offset + e.numel].view(e.param.shape)
            else:
                g = result[e.offset: e.offset + e.numel].view(-1)[: e.param.numel()].view(e.param.shape)
            p = e.param
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self.pool.give(*flight.lent)

    # ---- ZeRO-2 working copies --------------------------------------------------------------------
    def gather_if_stale(self) -> None:
        """All-gather the chunks into the working copies when any chunk changed since last time."""
        versions = tuple(e.param._version for e in self.entries)
        if versions == self._versions:
            return
        # Made for this gather and dropped after it: kept, they were a second whole copy of the
        # parameters (ZeRO-2 measured no saving over data parallel). A forward starts with few
        # activations alive, so they do not raise the step's peak.
        dtype = self.entries[0].full.dtype  # the working copies' (a policy's working dtype)
        shard = self._take(self.numel, dtype)  # (a chunk's padding rows are never read)
        out = self._take(self.n * self.numel, dtype)
        for e in self.entries:
            shard[e.offset: e.offset + e.param.numel()].copy_(e.param.detach().reshape(-1))
        _all_gather_flat(out, shard, group=self.handle.pg)
        rows = out.view(self.n, self.numel)
        if not self.identity:
            rows = rows[self.row_of_shard]
        with torch.no_grad():
            for e in self.entries:
                full = e.full.reshape(1, -1) if e.full.dim() == 0 else e.full.reshape(e.full.shape[0], -1)
                c = chunk_rows(full.shape[0], self.n)
                whole = rows[:, e.offset: e.offset + e.numel].reshape(self.n * c, full.shape[1])
                full.copy_(whole[: full.shape[0]])
        self.pool.give(shard, out)
        self._versions = tuple(e.param._version for e in self.entries)


class _Flight(NamedTuple):
    """A launched collective: its bucket, the tensor it writes, its work handle, the slots that
    got parts, (an all-reduce in another dtype) the buffer its sum goes back into, the pool's
    buffers it uses, and whether ``result`` holds every rank's parts (an all-to-all) or their sum."""

    bucket: _Bucket
    result: torch.Tensor
    work: object
    received: set
    home: torch.Tensor | None = None
    lent: tuple = ()
    parts: bool = False

    def finish(self) -> None:
        self.work.wait()
        self.bucket.finish(self)


@dataclasses.dataclass
class _Call:
    """One forward's view of the reducer: whether its backward synchronises, and per bucket how
    many of its parameters' gradients that backward has handed in."""

    reducer: "GradReducer"
    sync: bool
    arrived: dict = dataclasses.field(default_factory=dict)


_LIVE: "weakref.WeakSet[GradReducer]" = weakref.WeakSet()
_HOOK = None


def _flush_before_step(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: synchronise parts still pending for its parameters."""
    params = None
    for reducer in list(_LIVE):
        if not reducer.pending():
            continue
        if params is None:
            params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(id(e.param) in params for b in reducer.buckets for e in b.entries):
            reducer.synchronize()


class GradReducer:
    """Bucketed gradient synchronisation for one ParallelModule; see the module docstring."""

    def __init__(self, entries: list[SyncEntry], groups, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES):
        if bucket_bytes <= 0 or first_bucket_bytes <= 0:
            raise ConfigError(f"bucket sizes must be positive, got bucket_bytes={bucket_bytes}, first_bucket_bytes={first_bucket_bytes}")
        self.groups = groups
        self.bucket_bytes, self.first_bucket_bytes = bucket_bytes, first_bucket_bytes
        self.pool = _Pool()  # the ZeRO-2 buckets' buffers while they are summed or gathered
        self.buckets = self._make_buckets(entries)
        # kept: at most the buckets in use at once and a share of what ZeRO-2 saves, as the memory
        # model prices them
        split = [b for b in self.buckets if b.split]
        saved = zero2_saved_bytes([(b._flat_numel() * b.wire.itemsize, b.n) for b in split])
        self.pool.cap_bytes = max((zero2_pool_cap(b.sum_by, saved, bucket_bytes) for b in split), default=0)
        self._by_slot = {e.slot: b for b in self.buckets for e in b.entries}
        self.tapped = frozenset(self._by_slot)  # the state slots a tap reads
        self._next = 0  # the next bucket to launch in this backward
        self._ready: set[int] = set()
        self._inflight: list[_Flight] = []
        self._callback_queued = False
        self._sync_enabled = True
        self._defer_waits = False  # (``deferred_waits``)
        self.launched = 0  # collectives launched so far (tests, explain)
        _LIVE.add(self)
        global _HOOK
        if _HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK = register_optimizer_step_pre_hook(_flush_before_step)

    def _make_buckets(self, entries: list[SyncEntry]) -> list[_Bucket]:
        order = sorted(entries, key=lambda e: -e.first_use)  # the order backward finishes them
        items = [((e.sync.split, e.sync.sum_by, e.sync.axes, e.param.dtype, e.wire_dtype, e.param.device),
                  (e.full if e.sync.split else e.param).numel() * (e.wire_dtype or e.param.dtype).itemsize)
                 for e in order]
        made = assign_buckets(items, self.bucket_bytes, self.first_bucket_bytes)  # as the step model prices them
        return [_Bucket(i, self.groups.handle(key[2]), [order[k] for k in members], self.pool)
                for i, (key, members, _) in enumerate(made)]

    # ---- forward ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backwards of forwards run inside only accumulate; the next synchronised backward (or an
        optimizer step) synchronises the sum."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    def tap(self, state: list, sync: bool | None = None, reads: list | None = None) -> list:
        """The program's state inputs with every synchronised parameter read through a tap (call
        when autograd records the forward): a leaf of its own per forward, viewing what the program
        reads (the parameter, a policy's working copy, ZeRO-2's gathered one), whose gradient the
        reducer takes as soon as autograd has it (``_on_part``). A leaf's gradient node runs the
        moment its gradient is complete (autograd runs those first); a node made when the forward
        starts would run after every other one, so every gradient would wait for the end of
        backward, all alive at once, and no bucket's collective would start before it. ``sync``
        overrides whether this forward's backward synchronises (a pipeline's last microbatch does,
        inside ``no_sync()``: it launches its collectives, see ``deferred_waits``). ``reads``: what
        the program reads in place of ``state``'s parameters (a policy's working copies)."""
        call = _Call(self, self._sync_enabled if sync is None else sync)
        out = list(state if reads is None else reads)
        for b in self.buckets:
            if b.split:
                b.gather_if_stale()
            for k, e in enumerate(b.entries):
                leaf = (e.full if b.split else out[e.slot]).detach().requires_grad_()
                leaf.register_post_accumulate_grad_hook(functools.partial(self._on_part, call, b, k))
                out[e.slot] = leaf
        return out

    def working_copies(self, state: list) -> list:
        """The program's state inputs without taps (no-grad forwards): ZeRO-2 parameters replaced by
        their up-to-date working copies."""
        state = list(state)
        for b in self.buckets:
            if b.split:
                b.gather_if_stale()
                for e in b.entries:
                    state[e.slot] = e.full
        return state

    # ---- backward -------------------------------------------------------------------------------------
    def _on_part(self, call: _Call, bucket: _Bucket, k: int, leaf: torch.Tensor) -> None:
        """Entry ``k``'s gradient from a tap's leaf (``tap``): into its bucket (and off the leaf);
        the bucket launches once every entry's part of a synchronising backward is in (buckets in
        bucket order; one an entry of which got no gradient launches at the end of backward)."""
        part, leaf.grad = leaf.grad, None
        if call.sync and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        bucket.add([part if i == k else None for i in range(len(bucket.entries))])
        if not call.sync:
            return
        arrived = call.arrived[bucket.index] = call.arrived.get(bucket.index, 0) + 1
        if arrived < len(bucket.entries):
            return
        bucket.fired += 1
        if bucket.fired == 1 and bucket.index >= self._next:
            self._ready.add(bucket.index)
        while self._next in self._ready:
            self._launch(self.buckets[self._next])
            self._ready.discard(self._next)
            self._next += 1

    def accumulate(self, grads: dict, slots: list) -> None:
        """Parts computed outside the taps (the weight half of a split backward): state slot ->
        gradient part, added to the slot's bucket, or to the ``.grad`` of a parameter no
        collective synchronises (``slots[slot]``: its owner module and attribute). Synchronised by
        the next ``synchronize()``, as parts accumulated under ``no_sync()`` are."""
        per_bucket: dict = {}
        for slot, g in grads.items():
            bucket = self._by_slot.get(slot)
            if bucket is None:
                owner, attr = slots[slot]
                param = owner._parameters[attr]
                # (in a policy's working dtype: the master's gradient is in the master's)
                param.grad = g.detach().to(param.dtype, copy=True) if param.grad is None else param.grad.add_(g)
                continue
            per_bucket.setdefault(bucket.index, {})[slot] = g
        for index, parts in per_bucket.items():
            bucket = self.buckets[index]
            bucket.add([parts.get(e.slot) for e in bucket.entries])

    def _launch(self, bucket: _Bucket) -> None:
        self._inflight.append(bucket.launch())
        self.launched += 1
        if bucket.split:
            self._bound_scatters()

    def _bound_scatters(self) -> None:
        """Finish the oldest reduce-scatters while more than ``SCATTERS_IN_FLIGHT`` are in flight:
        each holds a whole bucket of gradients until it is done, and ZeRO-2 is there to not hold
        every gradient at once (FSDP bounds its reduce-scatters the same way)."""
        scatters = [i for i, f in enumerate(self._inflight) if f.bucket.split]
        for i in reversed(scatters[: max(0, len(scatters) - SCATTERS_IN_FLIGHT)]):
            self._inflight.pop(i).finish()

    @contextlib.contextmanager
    def deferred_waits(self):
        """Inside, a synchronising backward launches its collectives and returns; the caller's
        ``synchronize()`` waits for them. A pipeline's runner: the stage sends its input gradient
        as soon as its last backward ends (waited there, the last stage's sync held the previous
        stage's last backward, the step's critical path)."""
        old, self._defer_waits = self._defer_waits, True
        try:
            yield
        finally:
            self._defer_waits = old

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._defer_waits:
            self._launch_rest()
            return
        self.synchronize()

    def _launch_rest(self) -> None:
        """Launch every bucket still holding parts, in bucket order."""
        for b in self.buckets:
            if b.accum is not None:
                self._launch(b)

    def pending(self) -> bool:
        return bool(self._inflight) or any(b.accum is not None for b in self.buckets)

    def synchronize(self) -> None:
        """Launch every bucket still holding parts (in bucket order) and finish everything in
        flight. Collective: every rank calls it at the same point (end of backward, before an
        optimizer step)."""
        self._launch_rest()
        inflight, self._inflight = self._inflight, []
        for f in inflight:
            f.work.wait()
        for f in inflight:
            f.bucket.finish(f)
        for b in self.buckets:
            b.fired = 0
        self._next = 0
        self._ready.clear()

    # ---- introspection ----------------------------------------------------------------------------
    def describe(self) -> list[dict]:
        """One row per bucket: its collectives, mesh axes, parameters, bytes (what ``explain`` shows)."""
        return [{"kind": b.entries[0].sync.name, "axes": tuple(b.handle.axes), "params": len(b.entries),
                 "bytes": b.numel * (b.n if b.split else 1) * b.wire.itemsize}
                for b in self.buckets]


@torch.no_grad()
def unchunk(chunk: torch.Tensor, full_shape, handle) -> torch.Tensor:
    """The whole tensor of shape ``full_shape`` from every rank's dim-0 chunk (``chunk_of``) over
    ``handle``'s group. Collective."""
    n = handle.size
    full_shape = tuple(full_shape)
    d0 = full_shape[0] if full_shape else 1
    rest = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    c = chunk_rows(d0, n)
    piece = torch.zeros(c * rest, dtype=chunk.dtype, device=chunk.device)
    piece[: chunk.numel()].copy_(chunk.reshape(-1))
    out = piece.new_empty(n * c * rest)
    _all_gather_flat(out, piece, group=handle.pg)
    rows = out.view(n, c * rest)[list(handle.pg_of_shard)]
    return rows.reshape(n * c, rest)[:d0].reshape(full_shape)
