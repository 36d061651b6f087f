"""ParallelModule: one rank's part of a parallelized model, called like the original.

It owns this rank's parameter and buffer shards, registered under the original (canonical) names,
so ``pmodel.parameters()`` feeds any torch.optim optimizer, and runs the lowered program
(``autopar.codegen.lower``) with them and the caller's inputs::

    pmodel(*args, **kwargs)
      -> (args, kwargs) bound to the traced signature and flattened like the example inputs
      -> program(*shards, *inputs) inside ops.bind(groups)
      -> the flat outputs put back into the original structure (tensor, tuple, ModelOutput, ...);
         one the plan returns split over ranks (a language model's logits, which training does not
         read) is a ``SplitOutput``, gathered whole when first read (``autopar.runtime.outputs``)

Gradient synchronisation: under the dual-layout convention a parameter stored replicated over an
active mesh axis ends backward with a pending-sum gradient there. The module's ``GradReducer``
(``autopar.runtime.reducer``) sums those parts with bucketed collectives launched during backward
and finished once at its end, so a plain ``loss.backward(); opt.step()`` loop sees true gradients;
``no_sync()`` accumulates several backwards and synchronises once, as DDP's does. A ZeRO-2
parameter is exposed as this rank's dim-0 chunk of its storage shard (the optimizer updates only
that); the program reads the whole shard, which the reducer all-gathers when a chunk changed.

Like the original model it has a train and an eval mode and takes batches of any shape: a call
in another mode or with other input shapes runs a program built for it on first use
(``autopar.runtime.programs``, built by ``autopar.compose.programs``). A pipelined plan is called
the same way: the stages' forwards run in the call and their backwards when ``backward()`` reaches
its outputs (``autopar.runtime.pipeline_call``). Parameters are registered in the original model's order;
``state_dict()`` holds DTensors (``autopar.runtime.state``); ``clip_grad_norm_`` clips by the
global norm over every shard (``autopar.runtime.clip``).
"""
from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import _pytree as fx_pytree

from autopar.codegen import ops
from autopar.errors import ConfigError
from autopar.ir.graph import Role
from autopar.ir.precision import kept_dtype
from autopar.runtime.clip import ClipInfo, attach, clip_grad_norm_, counts_in_norm
from autopar.runtime.outputs import ReadCheck, output_names, split_returned
from autopar.runtime.programs import Program, call_key, start_loss_sum
from autopar.runtime.reducer import GradReducer, SyncEntry, chunk_of, storage_of, unchunk
from autopar.runtime.state import ParamLayout, device_mesh, local_part, to_dtensor


class ParallelModule(nn.Module):
    """See the module docstring. Built by ``autopar.parallelize``; ``.plan``, ``.code``,
    ``.mesh``, ``.groups``, ``full_state_dict()``."""

    def __init__(self, *, graph, plan, lowered, groups, shards: dict, state_keys: list[str],
                 signature: inspect.Signature | None, requires_grad: dict[str, bool], constants: dict,
                 order: list[str] | None = None, builder=None, mode: bool = True, device=None, example=None,
                 bucket_bytes: int | None = None, first_bucket_bytes: int | None = None, norm_group=None,
                 not_in_norm: frozenset = frozenset(), state: list[str] | None = None, precision=None,
                 read_world: bool = False):
        super().__init__()
        object.__setattr__(self, "_ap", _State(graph, plan, lowered, groups, state_keys, signature))
        # The placeholders whose tensors this module holds, one slot each: the program's state inputs,
        # or (a pipeline rank running several stages) the union of its programs'.
        state = list(lowered.state) if state is None else list(state)
        self._ap.state_names = state
        self._ap.device = device
        fqn_of = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
        persistent = set(state_keys)
        first_use = _first_use(graph)
        # Registered in the original model's order (parameters, then buffers), so named_parameters()
        # and a split of them into groups by name look like the original's.
        position = {fqn: i for i, fqn in enumerate(order or [])}
        by_position = sorted(range(len(state)), key=lambda i: position.get(fqn_of.get(state[i]), len(position) + i))
        self._ap.slots = [None] * len(state)  # per state placeholder: (owner module, attribute name)
        entries, counted = [], set()
        for slot in by_position:
            ph = state[slot]
            node = graph.nodes[ph]
            if node.role == Role.CONSTANT:
                owner, attr = self._owner("_autopar_constants." + ph)
                owner.register_buffer(attr, constants[ph], persistent=False)
            elif node.role == Role.PARAMETER:
                owner, attr = self._owner(fqn_of[ph])
                trainable = requires_grad.get(ph, True)
                param_plan = plan.params.get(fqn_of[ph])
                sync = param_plan.grad_sync if trainable and param_plan is not None else None
                shard = shards[ph]
                split = {a for ax in param_plan.storage.dim_axes for a in ax} if param_plan is not None else set()
                # under a policy that casts, gradients are summed in its reduction dtype, and a
                # ZeRO-2 working copy is gathered in the working dtype (the program reads nothing else)
                cast = precision is not None and precision.casts and shard.is_floating_point()
                wire = precision.reduce_dtype if precision is not None and shard.is_floating_point() else None
                if sync is not None and sync.split:  # ZeRO-2: the optimizer sees a chunk
                    g = groups.handle(sync.axes)
                    param = nn.Parameter(chunk_of(shard, g.index, g.size).clone(), requires_grad=True)
                    full = shard.to(precision.param_dtype) if cast else shard
                    entries.append(SyncEntry(slot, param, sync, first_use.get(ph, 0), full=full, wire_dtype=wire))
                    split |= set(sync.axes)
                else:
                    param = nn.Parameter(shard, requires_grad=trainable)
                    if sync is not None:
                        entries.append(SyncEntry(slot, param, sync, first_use.get(ph, 0), wire_dtype=wire))
                if counts_in_norm(split, groups.coordinate, groups.mesh.shape) and ph not in not_in_norm:
                    counted.add(id(param))
                owner.register_parameter(attr, param)
            else:
                owner, attr = self._owner(fqn_of[ph])
                owner.register_buffer(attr, shards[ph], persistent=fqn_of[ph] in persistent)
            self._ap.slots[slot] = (owner, attr)
        self._ap.precision = precision
        if precision is not None and precision.casts:
            self._ap.masters = frozenset(i for i, ph in enumerate(state) if graph.nodes[ph].role == Role.PARAMETER
                                         and shards[ph].is_floating_point())
        sizes = {k: v for k, v in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes)) if v is not None}
        self._ap.reducer = GradReducer(entries, groups, **sizes)
        self._ap.zero2 = {e.slot: e for e in entries if e.sync.split}
        slot_of = {ph: i for i, ph in enumerate(state)}
        main = Program(graph, plan, lowered, [slot_of[ph] for ph in lowered.state], {}, self._ap.in_spec, self._ap.out_spec)
        self._ap.slot_of_fqn = {fqn_of[ph]: i for i, ph in enumerate(state) if ph in fqn_of}
        self._ap.builder = builder
        self._ap.main = main
        self._ap.mode = bool(mode)
        self._ap.programs = {}
        # What decides that a call runs the main program: the traced mode, structure, tensor shapes
        # and dtypes, and non-tensor values (export bakes those in).
        ex_args, ex_kwargs = example if example is not None else ((), {})
        self._ap.main_key = call_key(mode, *self._normalize(tuple(ex_args), dict(ex_kwargs)))
        if norm_group is None:
            norm_group = groups.handle(tuple(range(groups.mesh.ndim))).pg
        # outputs returned split are gathered when read, once every rank agrees on which (``runtime.outputs``)
        self._ap.read_check = ReadCheck(range(dist.get_world_size()) if read_world else groups.global_ranks, groups.timeout)
        self._ap.clip = ClipInfo(counted, norm_group, self._ap.reducer.synchronize, device)
        attach(self.parameters(), self._ap.clip)
        self.train(mode)

    # ---- construction helpers ----------------------------------------------------------------
    def _owner(self, fqn: str) -> tuple[nn.Module, str]:
        """The (created on demand) container module that holds ``fqn``, and the last name part."""
        *path, attr = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = _Holder()
                mod.add_module(part, child)
            mod = child
        return mod, attr

    # ---- calling -------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        ap = self._ap
        if ap.pipeline is not None:  # the stages' forwards now, their backwards in backward()
            args, kwargs = self._normalize(args, kwargs)
            flat = fx_pytree.tree_flatten_spec((args, kwargs), ap.in_spec)
            flat = ap.placed(flat)
            ap.calls += 1
            return pytree.tree_unflatten(ap.pipeline.call(self.training, flat), ap.out_spec)
        program, out = self._run(args, kwargs)
        ap.calls += 1
        out = split_returned(list(out), program.lowered.returned, ap.groups, ap.read_check, ap.calls,
                             output_names(program.out_spec, len(out)))
        return pytree.tree_unflatten(out, program.out_spec)

    def _run(self, args, kwargs, program_of=None):
        """(program, its flat outputs) of this call; ``program_of(program)`` picks another module
        of the program to run (``Program.loss_only``)."""
        ap = self._ap
        args, kwargs = self._normalize(args, kwargs)
        program, flat = self._program(args, kwargs)
        flat = ap.placed(flat)
        state = ap.program_state()
        gm = program.lowered.gm if program_of is None else program_of(program)
        with ops.bind(ap.groups):
            out = gm(*program.state_inputs(state), *flat)
        return program, out

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the whole batch, gradients synchronised and ready for
        ``optimizer.step()``; returns the (detached) loss, on every rank. The model must compute
        its loss (return it, or a tuple / ModelOutput holding it). For every plan, pipelined or not.

        The fast path: it runs the loss alone (no other output is made whole: a language model's
        logits are never gathered), and a pipelined plan under torch's schedule (1F1B, interleaved,
        zero bubble), which keeps fewer microbatches in flight than the GPipe order a call runs
        when its backward is left to the caller (``autopar.runtime.pipeline_call``)."""
        ap = self._ap
        if ap.pipeline is None:
            program, (loss,) = self._run(args, kwargs, Program.loss_only)
            total, summed = start_loss_sum(loss, program.loss_sum_axes, ap.groups)
            loss.backward()
            summed()
            return total
        args, kwargs = self._normalize(args, kwargs)
        flat = fx_pytree.tree_flatten_spec((args, kwargs), ap.in_spec)
        flat = ap.placed(flat)
        ap.pipeline.check_call(self.training, flat)
        return ap.pipeline.step(flat)

    def _program(self, args, kwargs):
        """The program for this call's mode and inputs, and the inputs flattened for it: the main
        program, or one built (and cached) on first use; see ``autopar.runtime.programs``."""
        ap = self._ap
        key = call_key(self.training, args, kwargs)
        if key == ap.main_key:
            return ap.main, fx_pytree.tree_flatten_spec((args, kwargs), ap.in_spec)
        program = ap.programs.get(key)
        if program is None:
            if ap.builder is None:
                raise ConfigError(f"{ap.graph.model_name} was parallelized without a way to re-trace it; call it in the "
                                  "mode and with the input shapes it was parallelized for")
            built = sum(p is not ap.main for p in ap.programs.values())
            program = ap.builder.build(self.training, args, kwargs, ap.slot_of_fqn, built) or ap.main
            ap.programs[key] = program
        return program, fx_pytree.tree_flatten_spec((args, kwargs), program.in_spec)

    @property
    def programs(self) -> dict:
        """The programs built beyond the main one, by (mode, input shapes) (a call whose trace was
        the main program's graph is not listed: it runs the main program)."""
        return {k: v for k, v in self._ap.programs.items() if v is not self._ap.main}

    def _normalize(self, args, kwargs):
        """(args, kwargs) arranged like the traced call: as many positional arguments and the same
        keywords, whichever way the caller passed them."""
        sig = self._ap.signature
        n_pos, keys = self._ap.n_pos, self._ap.kw_keys
        if sig is None or (len(args) == n_pos and set(kwargs) == set(keys)):
            return tuple(args), dict(kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            raise ConfigError(f"cannot call {self._ap.graph.model_name} this way: {err}") from None
        bound.apply_defaults()
        names = list(sig.parameters)
        values = dict(bound.arguments)
        pos = tuple(values.pop(n) for n in names[:n_pos] if n in values)
        return pos, {k: values[k] for k in keys if k in values}

    # ---- views ---------------------------------------------------------------------------------
    @property
    def plan(self):
        """The plan this module runs (with every pipeline stage; ``stage_plan`` is this rank's)."""
        return self._ap.plan_full or self._ap.plan

    @property
    def stage_plan(self):
        """The intra-op plan of this rank's pipeline stage (the plan itself when it has one stage)."""
        return self._ap.plan

    @property
    def stage(self) -> int:
        """This rank's (first) pipeline stage (0 for a plan of one stage)."""
        return self.stages[0]

    @property
    def stages(self) -> list[int]:
        """The pipeline stages this rank runs (several under interleaved 1F1B)."""
        return [0] if self._ap.pipeline is None else list(self._ap.pipeline.sg.stages)

    @property
    def code(self) -> str:
        """This rank's program as Python (the same text on every rank)."""
        ap = self._ap
        if ap.pipeline is not None:  # this rank's stages, in order
            return "\n".join(f"# stage {m.cut.index}\n{m.feeds.lowered.gm.code}" for m in ap.pipeline.modules)
        return ap.lowered.gm.code

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._ap.lowered.gm

    @property
    def mesh(self):
        return self._ap.groups.mesh

    @property
    def groups(self):
        return self._ap.groups

    def local_state(self) -> dict[str, torch.Tensor]:
        """Canonical fqn -> the tensor this rank holds for it: the storage shard of parameters and
        buffers, or for a ZeRO-2 parameter this rank's dim-0 chunk of it (what the optimizer sees)."""
        fqn_of = {ph: fqn for fqn, ph in {**self._ap.graph.params, **self._ap.graph.buffers}.items()}
        out = {}
        for (owner, a), ph in zip(self._ap.slots, self._ap.state_names):
            if ph in fqn_of:
                out[fqn_of[ph]] = owner._parameters[a] if a in owner._parameters else owner._buffers[a]
        return out

    def storage_spec(self, fqn: str):
        """The storage spec of parameter or buffer ``fqn`` (canonical name)."""
        return self._ap.plan.params[fqn].storage

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards of forwards run inside this block only accumulate gradient parts; the next
        backward outside it (or the next optimizer step) synchronises their sum once (as DDP's
        ``no_sync``). Every rank must use it alike."""
        with self._ap.reducer.no_sync():
            yield

    @property
    def reducer(self) -> GradReducer:
        return self._ap.reducer

    @torch.no_grad()
    def _storage_shards(self, grads: bool = False, names=None) -> dict[str, torch.Tensor]:
        """Canonical fqn -> this rank's storage shard (or its gradient, None where there is none),
        of every parameter and buffer or of ``names``. Collective where ZeRO-2 chunks must be
        gathered (every rank of their group asks for the same names)."""
        ap = self._ap
        fqn_of = {ph: fqn for fqn, ph in {**ap.graph.params, **ap.graph.buffers}.items()}
        out = {}
        if not grads:
            ap.reducer.working_copies([None] * len(ap.slots))  # refresh ZeRO-2 working copies
        for slot, ((owner, a), ph) in enumerate(zip(ap.slots, ap.state_names)):
            if ph not in fqn_of or (names is not None and fqn_of[ph] not in names):
                continue
            t = owner._parameters[a] if a in owner._parameters else owner._buffers[a]
            entry = ap.zero2.get(slot)
            if grads:
                g = t.grad if isinstance(t, nn.Parameter) else None
                if entry is not None and g is not None:  # (None alike on every rank: the same program ran)
                    g = unchunk(g, entry.full.shape, ap.groups.handle(entry.sync.axes))
                out[fqn_of[ph]] = g
            elif entry is not None and entry.full.dtype != t.dtype:  # a working copy: the masters, gathered
                out[fqn_of[ph]] = unchunk(t.detach(), entry.full.shape, ap.groups.handle(entry.sync.axes))
            else:
                out[fqn_of[ph]] = entry.full if entry is not None else t
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict with the original model's keys (tied aliases included), on
        every rank (of every pipeline stage). A collective: call it on every rank."""
        ap = self._ap
        full = {fqn: ops.gather_full(t.detach(), self.storage_spec(fqn), ap.groups) for fqn, t in self._storage_shards().items()}
        if ap.pipeline is not None:
            return ap.pipeline.across_stages(full, ap.all_state_keys, ap.canonical)
        out = {}
        for key in ap.state_keys:
            canon = ap.canonical.get(key, key)
            if canon in full:
                out[key] = full[canon]
        return out

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Canonical parameter fqn -> its full (unsharded) gradient, on every rank (None where the
        parameter has none on every rank): copies, which later steps leave as they are (a
        replicated parameter's ``.grad`` is a view of the reducer's bucket, which the next
        backward writes). A collective: call it on every rank, after the gradients are synchronised
        (after ``backward()`` outside ``no_sync()``)."""
        ap = self._ap
        ap.reducer.synchronize()
        out = {}
        for fqn, g in self._storage_shards(grads=True).items():
            if fqn in ap.graph.params and ap.graph.nodes[ap.graph.params[fqn]].role == Role.PARAMETER:
                if g is None:
                    out[fqn] = None
                else:
                    full = ops.gather_full(g, self.storage_spec(fqn), ap.groups)
                    out[fqn] = full.clone() if full is g else full
        if ap.pipeline is not None:
            names = [f for f, ph in ap.graph.params.items() if ap.graph.nodes[ph].role == Role.PARAMETER]
            return ap.pipeline.across_stages(out, names, {})
        return out


    def compare_nodes(self, *args, tol: float = 1e-5, **kwargs):
        """Run this call node by node next to one process and report, per traced node, how far
        its gathered value is from the single-device one; ``.first`` is the first node that
        differs (``autopar.runtime.debug``). A collective: every rank calls it with the same inputs."""
        from autopar.runtime.debug import compare_nodes

        return compare_nodes(self, args, kwargs, tol)

    # ---- the training loop's other calls ---------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip every gradient by the global norm over all shards and return that norm (the same
        on every rank), as ``torch.nn.utils.clip_grad_norm_`` on the original model would. A
        collective. ``torch.nn.utils.clip_grad_norm_(pmodel.parameters(), ...)`` does the same."""
        return clip_grad_norm_(self._ap.clip, self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach)

    def param_layouts(self) -> dict:
        """Parameter name -> its ``ParamLayout`` (how the tensor the optimizer sees sits in the
        whole parameter): what checkpoints lay optimizer states out by."""
        ap = self._ap
        dm = device_mesh(ap.groups, ap.device)
        out = {}
        for fqn, slot in ap.slot_of_fqn.items():
            if fqn not in ap.graph.params:
                continue
            entry = ap.zero2.get(slot)
            out[fqn] = ParamLayout(self.storage_spec(fqn), dm, fqn, entry.sync.axes if entry is not None else ())
        return out

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The original model's keys (tied aliases included), each a DTensor whose local part is this
        rank's storage shard (see ``autopar.runtime.state``). ``full_state_dict()`` gives plain
        full tensors instead. Collective only where ZeRO-2 chunks must be gathered."""
        if args:
            raise ConfigError("ParallelModule.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        ap = self._ap
        dm = device_mesh(ap.groups, ap.device)
        shards = self._storage_shards()
        out = destination if destination is not None else OrderedDict()
        made: dict = {}
        for key in ap.state_keys:
            canon = ap.canonical.get(key, key)
            if canon not in shards:
                continue
            if canon not in made:
                t = shards[canon] if keep_vars else shards[canon].detach()
                made[canon] = to_dtensor(t, self.storage_spec(canon), dm, key)
            out[prefix + key] = made[canon]
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensors (of this plan, or of any other: gathered, then sliced) or full tensors
        under the original model's keys; a tied weight needs one of its names. Returns torch's
        ``(missing_keys, unexpected_keys)``; with ``strict`` either raises a ConfigError. Every
        rank must call it (a DTensor of another layout is gathered). A module holding this one
        loads it through ``_load_from_state_dict`` the same way."""
        from torch.nn.modules.module import _IncompatibleKeys

        if assign:
            raise ConfigError("load_state_dict(assign=True) would replace the shards the program reads; use assign=False")
        missing, unexpected = self._keys_against(state_dict)
        if strict and (missing or unexpected):
            raise ConfigError(
                f"error loading the state dict of {self._ap.graph.model_name}: missing keys {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )
        self._load(state_dict)
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """torch's per-module hook, for a parent's ``load_state_dict``: this module's keys are
        under ``prefix``; the containers holding the shards load nothing themselves."""
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        missing, unexpected = self._keys_against(mine)
        missing_keys += [prefix + k for k in missing]
        unexpected_keys += [prefix + k for k in unexpected]
        try:
            self._load(mine)
        except ConfigError as err:
            error_msgs.append(str(err))

    def _keys_against(self, state_dict) -> tuple[list[str], list[str]]:
        ap = self._ap
        known = set(ap.state_keys)
        unexpected = [k for k in state_dict if k not in known]
        missing = [names[0] for names in self._names_by_canonical().values() if not any(n in state_dict for n in names)]
        return missing, unexpected

    def _names_by_canonical(self) -> dict[str, list[str]]:
        ap = self._ap
        out: dict[str, list[str]] = {}
        for key in ap.state_keys:
            out.setdefault(ap.canonical.get(key, key), []).append(key)
        return out

    @torch.no_grad()
    def _load(self, state_dict) -> None:
        ap = self._ap
        dm = device_mesh(ap.groups, ap.device)
        shards = self._storage_shards()
        for canon, names in self._names_by_canonical().items():
            present = [n for n in names if n in state_dict]
            if not present or canon not in shards:
                continue
            spec = self.storage_spec(canon)
            local = local_part(state_dict[present[0]], spec, dm, ap.groups.mesh, ap.groups.rank, present[0])
            target = shards[canon]
            if local.dtype != target.dtype and not (local.is_floating_point() and target.is_floating_point()):
                raise ConfigError(f"{present[0]} has dtype {local.dtype}, the model's is {target.dtype}")
            target.copy_(local.to(target.device))
            entry = ap.zero2.get(ap.slot_of_fqn[canon])
            if entry is not None:  # the optimizer's chunk follows the loaded working copy
                g = ap.groups.handle(entry.sync.axes)
                entry.param.copy_(chunk_of(target, g.index, g.size))


class _Holder(nn.Module):
    """A container on the path of an original name; the ParallelModule loads its tensors."""

    def _load_from_state_dict(self, *args, **kwargs):
        pass


class _State:
    """Everything a ParallelModule needs that is not a tensor (kept out of the module tree)."""

    def __init__(self, graph, plan, lowered, groups, state_keys, signature):
        self.graph, self.plan, self.lowered, self.groups = graph, plan, lowered, groups
        self.state_keys = list(state_keys)
        self.signature = signature
        self.canonical = {a: canon for canon, names in graph.param_aliases.items() for a in names}
        spec = graph.exported.call_spec
        self.in_spec, self.out_spec = spec.in_spec, spec.out_spec
        self.n_pos = self.in_spec.child(0).num_children
        self.kw_keys = list(self.in_spec.child(1).context)
        self.device = None
        self.slots: list = []
        self.pipeline = None  # a PipelineRunner when the plan has stages (this module is one stage's)
        self.plan_full = None  # the plan with every stage (``plan`` is this stage's)
        self.all_state_keys = self.state_keys  # every stage's keys (full_state_dict)
        # Mixed precision (the MixedPrecision the module runs, or None): the programs read the slots
        # of ``masters`` (floating parameters, kept in the master dtype) as working-dtype copies
        # kept from call to call (``_working``); the reducer's taps take them beside the masters
        # and add the working dtype's gradients into their master-dtype sums.
        self.precision = None
        self.masters: frozenset = frozenset()
        self.zero2: dict = {}  # slot -> ZeRO-2 SyncEntry
        self.calls = 0  # calls so far: names the call a split output came from (``runtime.outputs``)
        self.read_check = None
        self._kept: dict = {}  # master slot -> (the master, its (version, data pointer) when cast, the working copy)

    def held_dtype(self, graph, ph: str) -> torch.dtype:
        """The dtype this module keeps placeholder ``ph`` of ``graph`` in (``kept_dtype``)."""
        return kept_dtype(getattr(torch, graph.nodes[ph].meta.dtype), graph.nodes[ph].role == Role.PARAMETER,
                          self.precision)

    def placed(self, flat: list) -> list:
        """The call's flat inputs as the program takes them: on the module's device, floating ones
        in the working dtype under a precision (as the plan was traced)."""
        dtype = self.precision.param_dtype if self.precision is not None else None
        return [x.to(device=self.device, dtype=dtype if dtype is not None and x.is_floating_point() else None)
                if isinstance(x, torch.Tensor) else x for x in flat]

    def program_state(self, sync: bool | None = None) -> list:
        """What the program reads for each slot: the parameters (or their working copies) through
        the reducer's taps when gradients are enabled (``sync``: see ``GradReducer.tap``), else the
        working copies."""
        state = [owner._parameters[a] if a in owner._parameters else owner._buffers[a] for owner, a in self.slots]
        if not torch.is_grad_enabled():
            return self._working(self.reducer.working_copies(state))
        return self.reducer.tap(state, sync, reads=self._working(state, skip=self.zero2, link=True))

    def _working(self, state: list, skip=(), link: bool = False) -> list:
        """``state`` with each master replaced by its working-dtype copy (``skip``: slots another
        working copy replaces: ZeRO-2's gathered ones). The copy is kept from call to call and cast
        again only when its master changed (an optimizer step or a loaded state moves the master's
        version), so a step casts once however many microbatches or forwards it runs, into memory
        it already has: cast anew each forward, the copies paid their allocation's page faults
        every microbatch, and their cast's backward ran once per parameter. ``link``: a master no
        bucket taps reads it through ``_FromWorking``, which gives it its gradient."""
        if not self.masters:
            return state
        out = list(state)
        for i in self.masters:
            if i in skip:
                continue
            master = state[i]
            seen = (master._version, storage_of(master))  # (``.data`` swapped, as ``module.to()`` does: a new storage)
            kept = self._kept.get(i)
            if kept is None or kept[0] is not master or kept[1] != seen:
                copy = kept[2] if kept is not None and kept[0] is master and kept[2].device == master.device else \
                    torch.empty_like(master, dtype=self.precision.param_dtype, requires_grad=False)
                with torch.no_grad():
                    copy.copy_(master)
                kept = self._kept[i] = (master, seen, copy)
            out[i] = _FromWorking.apply(master, kept[2]) if link and i not in self.reducer.tapped else kept[2]
        return out


class _FromWorking(torch.autograd.Function):
    """A master's kept working copy as the program reads it, with the master's gradient (the
    working dtype's, cast to the master's dtype: what ``master.to(dtype)``'s backward gives)."""

    @staticmethod
    def forward(ctx, master, working):
        ctx.dtype = master.dtype
        return working.view_as(working)

    @staticmethod
    def backward(ctx, grad):
        return (None if grad is None else grad.to(ctx.dtype)), None


def _first_use(graph) -> dict[str, int]:
    """Placeholder name -> position of the first node that reads it."""
    out: dict[str, int] = {}
    for i, node in enumerate(graph.nodes.values()):
        for src in node.inputs:
            out.setdefault(src, i)
    return out
