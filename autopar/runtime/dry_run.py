"""One rank's program run in this process against a fake world: what it issues, what it holds, and
whether the ranks it talks to would issue the same.

A dry run builds and runs the programs of sampled ranks one after another in one process, on meta
tensors (shapes and dtypes, no data, no memory) over torch's fake process group
(``dist.init_process_group("fake")``: every collective returns at once and moves nothing). What
decides whether a real job hangs or computes garbage is then visible without a cluster:

- ``FakeWorld(rank, world_size)``: the fake default group for one simulated rank. Object collectives
  (``broadcast_object_list``, ``all_gather_object``) carry Python values a fake group cannot move:
  a receiver takes what its source sent earlier in the same dry run (``payloads``, shared between
  the simulated ranks), so sources run first. torch's pipelining votes on static or dynamic
  shapes by multiplying flags sent from stage to stage and reading the product (``.item()``),
  which a meta tensor has not: its messages are still sent and received (and checked), and
  each rank takes the product of its own stages' votes, as every stage autopar builds votes alike.
  Attention on meta tensors would run torch's unfused math (meta has no kernel choice of its own):
  ``FusedAttention`` runs the fused kernel wherever the CPU would pick it (the GPU's flash and
  memory-efficient kernels hold what it holds: the output and a row statistic, no score matrix).
- ``Recorder``: a dispatch mode that lists every collective a rank issues (kind, its group by name
  and members, shapes, dtypes, the peer of a send or receive, the root of a broadcast), counts the
  other ops, and follows the bytes of the tensors the program holds on its device: from
  ``track(held)`` on (the module's parameters and buffers; building the module also makes meta
  copies of the whole model to trace, which are bookkeeping, not the program's memory), every
  storage an op makes, until Python frees it; held at a step's start and the peak during it.
- ``check``: the collectives of ranks that share a group must agree call by call on that group
  (same order, kind, shapes, dtypes, root), and every send must meet its receive; the first
  disagreement is named by rank, group and call.

Only the sampled ranks are compared: a group with one sampled member is not checked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.errors import ConfigError
from autopar.runtime.reducer import storage_of

c10d = torch.ops.c10d

# c10d op -> (kind, index of its process group argument, index of a root or peer (group rank) or None)
COLLECTIVE_OPS = {
    c10d.allreduce_.default: ("all_reduce", 1, None),
    c10d._allgather_base_.default: ("all_gather", 2, None),
    c10d.allgather_.default: ("all_gather", 2, None),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 2, None),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 2, None),
    c10d.reduce_scatter_.default: ("reduce_scatter", 2, None),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 2, None),
    c10d.alltoall_base_.default: ("all_to_all", 2, None),
    c10d.alltoall_.default: ("all_to_all", 2, None),
    c10d.broadcast_.default: ("broadcast", 1, 2),
    c10d.reduce_.default: ("reduce", 1, 3),
    c10d.gather_.default: ("gather", 2, 3),
    c10d.scatter_.default: ("scatter", 2, 3),
    c10d.barrier.default: ("barrier", 1, None),
    c10d.send.default: ("send", 1, 2),
    c10d.recv_.default: ("recv", 1, 2),
}
POINT_TO_POINT = ("send", "recv")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective call as a rank issued it."""

    kind: str
    group: str  # the process group's name: the same on every rank that made its groups in one order
    ranks: tuple[int, ...]  # the group's members (global ranks)
    shapes: tuple[tuple[int, ...], ...]  # of the tensors it sends (for a receive: receives)
    dtypes: tuple[str, ...]
    peer: int | None = None  # send / recv: the global rank at the other end; broadcast etc.: the root

    def agrees(self, other: "Collective") -> bool:
        return (self.kind, self.group, self.shapes, self.dtypes, self.peer) == (
            other.kind, other.group, other.shapes, other.dtypes, other.peer)

    def __str__(self) -> str:
        tensors = tensors_text(self.shapes, self.dtypes) or "no tensors"
        peer = {"send": " to rank", "recv": " from rank"}.get(self.kind, " root rank")
        return f"{self.kind} of {tensors}" + (f"{peer} {self.peer}" if self.peer is not None else "")

    def to_json(self) -> dict:
        return {"kind": self.kind, "group": self.group, "ranks": list(self.ranks), "shapes": [list(s) for s in self.shapes],
                "dtypes": list(self.dtypes), "peer": self.peer}


def tensors_text(shapes, dtypes) -> str:
    """``float32[4, 8], int64[2]``."""
    return ", ".join(f"{d}{list(s)}" for s, d in zip(shapes, dtypes))


def ranks_text(ranks) -> str:
    """A group's members, the first few and the last of a long one."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}] ({len(ranks)})"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _sent(kind: str, args) -> list[torch.Tensor]:
    """The tensors a collective sends (what every member's call must agree on)."""
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
    if kind == "barrier":
        return []
    return [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]


def _describe(func, args) -> Collective:
    from torch._C._distributed_c10d import ProcessGroup

    kind, pg_at, peer_at = COLLECTIVE_OPS[func]
    pg = ProcessGroup.unbox(args[pg_at])
    members = tuple(dist.get_process_group_ranks(pg))
    peer = None
    if peer_at is not None and kind != "barrier":
        peer = members[int(args[peer_at])]
    tensors = _sent(kind, args)
    return Collective(kind, pg.group_name, members, tuple(tuple(t.shape) for t in tensors),
                      tuple(_dtype(t) for t in tensors), peer)


class Recorder(TorchDispatchMode):
    """Lists the collectives of the program run under it, counts its other ops, and follows the
    bytes of the storages on ``device`` that it makes once ``track()`` is called (see the module
    docstring). ``start_step()`` marks the step measured: ``ops`` and ``peak_bytes`` count from
    there, ``held_bytes`` is what was alive then."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = device
        self.collectives: list[Collective] = []
        self.step_from = 0  # index of the measured step's first collective
        self.ops = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.held_bytes = 0
        self._live: dict[int, int] = {}
        self.tracking = False
        self._paused = 0  # > 0 inside an object collective, listed as itself

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COLLECTIVE_OPS:
            if not self._paused:
                self.collectives.append(_describe(func, args))
        else:
            self.ops += 1
        if self.tracking:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.hold(t)
        return out

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once) until Python frees it."""
        from torch._subclasses.fake_tensor import FakeTensor

        if t.device.type != self.device or isinstance(t, FakeTensor):  # a trace's shapes hold nothing
            return
        storage = t.untyped_storage()
        key = storage_of(t)
        if key in self._live:
            return
        self._live[key] = storage.nbytes()
        self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def track(self, held=()) -> None:
        """Follow memory from here: ``held`` (what the program keeps, made before) and every
        storage made from now on."""
        self.tracking = True
        for t in held:
            self.hold(t)

    def start_step(self) -> None:
        """The measured step starts: peak and op count restart."""
        self.held_bytes = self.peak_bytes = self.live_bytes
        self.ops = 0
        self.step_from = len(self.collectives)

    @contextlib.contextmanager
    def paused(self):
        """Collectives run inside are not listed."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def object_collective(self, kind: str, group, count: int, root: int | None) -> None:
        pg = group if group is not None else dist.group.WORLD
        members = tuple(dist.get_process_group_ranks(pg))
        self.collectives.append(Collective(kind, pg.group_name, members, ((count,),), ("object",), root))


class ObjectCalls:
    """Object collectives (``broadcast_object_list``, ``all_gather_object``) listed by ``recorder``
    as one call each (a context manager). In a real world they then run as torch runs them
    (their inner tensor collectives not listed); in a fake one (``payloads`` given: what sources
    sent, by (group, call), shared between the simulated ranks of one dry run) a receiver takes
    what its source sent, and an all-gather gives every member this rank's object."""

    def __init__(self, recorder: Recorder, payloads: dict | None = None):
        self.recorder, self.payloads = recorder, payloads
        self._calls: dict[str, int] = {}
        self._torch: dict[str, Any] = {}

    def __enter__(self):
        self._torch = {"broadcast_object_list": dist.broadcast_object_list, "all_gather_object": dist.all_gather_object}
        dist.broadcast_object_list = self._broadcast_object_list
        dist.all_gather_object = self._all_gather_object
        return self

    def __exit__(self, *exc):
        for name, fn in self._torch.items():
            setattr(dist, name, fn)
        return False

    def _next(self, group) -> tuple[str, int]:
        name = (group if group is not None else dist.group.WORLD).group_name
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        return name, n

    def _broadcast_object_list(self, object_list, src=None, group=None, device=None, group_src=None):
        import copy

        src = src if src is not None else dist.get_global_rank(group or dist.group.WORLD, group_src or 0)
        self.recorder.object_collective("broadcast_object", group, len(object_list), src)
        key = self._next(group)
        if self.payloads is None:
            with self.recorder.paused():
                return self._torch["broadcast_object_list"](object_list, src=src, group=group, device=device)
        if dist.get_rank() == src:
            self.payloads[key] = copy.deepcopy(list(object_list))
            return None
        if key not in self.payloads:
            raise ConfigError(f"dry run: rank {dist.get_rank()} receives Python objects from rank {src} (call {key[1]} on "
                              f"group {key[0]}), which has not run yet in this dry run: include rank {src} among the ranks")
        object_list[:] = copy.deepcopy(self.payloads[key])
        return None

    def _all_gather_object(self, object_list, obj, group=None):
        self.recorder.object_collective("all_gather_object", group, 1, None)
        self._next(group)
        if self.payloads is None:
            with self.recorder.paused():
                return self._torch["all_gather_object"](object_list, obj, group=group)
        object_list[:] = [obj] * len(object_list)  # the members' agreement is what the record checks
        return None


class FusedAttention(TorchFunctionMode):
    """Scaled dot-product attention on meta tensors through the fused kernel wherever the CPU
    would choose it for the same shapes, dtypes and options (torch chooses a kernel only for
    CPU and CUDA tensors, and runs meta ones through the unfused math)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # a program's meta tensors, not a trace's fake ones (what is traced stays what the user wrote)
        if func in _attention() and args and type(args[0]) is torch.Tensor and args[0].is_meta:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _attention() -> set:
    return {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    from torch.nn.attention import SDPBackend

    def cpu(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)

    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # asking is not the program's work
        choice = torch._fused_sdp_choice(cpu(q), cpu(k), cpu(v), cpu(attn_mask), dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                                         scale=scale)[0]


class FakeWorld:
    """The fake default process group of ``rank`` in a world of ``world_size``, for one simulated
    rank (a context manager; every group made inside is fake too), with object collectives
    (``ObjectCalls``, fake) and torch pipelining's warm-up vote (``_warmup_p2p``) made to work
    without data, and attention fused as a device runs it (``FusedAttention``)."""

    def __init__(self, rank: int, world_size: int, recorder: Recorder, payloads: dict):
        self.rank, self.world_size = rank, world_size
        self.objects = ObjectCalls(recorder, payloads)

    def __enter__(self):
        from torch.distributed.pipelining import schedules
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise ConfigError("a dry run simulates ranks in this process and needs it without a process group; "
                              "run it outside torchrun / srun (or destroy the process group first)")
        # meta tensors are what it moves: the fake backend serves them too
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        self.objects.__enter__()
        self.attention = FusedAttention()
        self.attention.__enter__()
        schedules._PipelineSchedule._torch_warmup_p2p = schedules._PipelineSchedule._warmup_p2p
        schedules._PipelineSchedule._warmup_p2p = _warmup_p2p
        return self

    def __exit__(self, *exc):
        from torch.distributed.pipelining import schedules

        schedules._PipelineSchedule._warmup_p2p = schedules._PipelineSchedule.__dict__["_torch_warmup_p2p"]
        del schedules._PipelineSchedule._torch_warmup_p2p
        self.attention.__exit__(*exc)
        self.objects.__exit__(*exc)
        dist.destroy_process_group()
        return False


def _warmup_p2p(schedule, stages, has_backward, p2p_done) -> None:
    """torch's pipelining warm-up (``_PipelineSchedule._warmup_p2p``, torch 2.13) on meta tensors:
    the same vote messages, the mode from this rank's own stages' votes."""
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining._utils import InferenceMode

    if not all(isinstance(stage, PipelineStage) for stage in stages):  # torch's other path reads no values
        return schedules._PipelineSchedule.__dict__["_torch_warmup_p2p"](schedule, stages, has_backward, p2p_done)
    acc = None
    for stage in stages:
        acc = stage._warmup_forward_vote(has_backward, received_acc=acc)
    static = not any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
    result = acc
    for stage in reversed(stages):
        result = stage._warmup_backward_result(received_result=result)
        stage._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC


# ---- the peers' agreement -----------------------------------------------------------------------
def check(records: dict[int, list[Collective]]) -> list[str]:
    """Where the sampled ranks' collectives disagree, first disagreement per group first: for
    every group, its sampled members' calls on it in order; for every send, the receive of its
    peer (when the peer was sampled). Empty when all agree."""
    problems: list[str] = []
    groups: dict[str, tuple[int, ...]] = {}
    for calls in records.values():
        for c in calls:
            if c.kind not in POINT_TO_POINT:
                groups.setdefault(c.group, c.ranks)
    for name, members in groups.items():
        sampled = [r for r in members if r in records]
        if len(sampled) < 2:
            continue
        seqs = {r: [c for c in records[r] if c.group == name and c.kind not in POINT_TO_POINT] for r in sampled}
        first = sampled[0]
        for r in sampled[1:]:
            problem = _first_difference(first, seqs[first], r, seqs[r], f"group {name} (ranks {ranks_text(members)})")
            if problem:
                problems.append(problem)
                break
    for a, calls in records.items():
        for b in sorted({c.peer for c in calls if c.kind == "send"}):
            if b not in records:
                continue
            sends = [c for c in calls if c.kind == "send" and c.peer == b]
            recvs = [c for c in records[b] if c.kind == "recv" and c.peer == a]
            problem = _first_p2p_difference(a, sends, b, recvs)
            if problem:
                problems.append(problem)
    return problems


def _first_difference(a: int, xs: list[Collective], b: int, ys: list[Collective], where: str) -> str | None:
    for i, (x, y) in enumerate(zip(xs, ys)):
        if not x.agrees(y):
            return f"call {i} on {where}: rank {a} issues {x}, rank {b} issues {y}"
    if len(xs) != len(ys):
        short, long_, n = (a, b, len(xs)) if len(xs) < len(ys) else (b, a, len(ys))
        extra = (ys if long_ == b else xs)[n]
        return (f"call {n} on {where}: rank {long_} issues {extra}, rank {short} issues nothing more "
                f"({len(xs)} calls against {len(ys)}): rank {long_} would wait for ever")
    return None


def _first_p2p_difference(a: int, sends: list[Collective], b: int, recvs: list[Collective]) -> str | None:
    for i, (s, r) in enumerate(zip(sends, recvs)):
        if (s.shapes, s.dtypes, s.group) != (r.shapes, r.dtypes, r.group):
            return (f"send {i} from rank {a} to rank {b}: rank {a} sends {tensors_text(s.shapes, s.dtypes)}, "
                    f"rank {b} receives {tensors_text(r.shapes, r.dtypes)}")
    if len(sends) != len(recvs):
        return f"rank {a} sends {len(sends)} messages to rank {b}, which receives {len(recvs)}: one of them would wait for ever"
    return None
