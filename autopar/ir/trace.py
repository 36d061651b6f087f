"""``trace``: torch.export (non-strict, training IR) -> Graph.

The exported program is kept as is (no decompositions), so ops such as ``aten.linear``,
``aten.scaled_dot_product_attention`` and ``aten.layer_norm`` stay whole for the sharding rules.
The model runs in whatever mode it is in: a model in training mode keeps its dropout ops.

Models as they ship: a transformers model built from a default config returns a key/value cache
for generation (``use_cache=True``), an object torch.export cannot return; training reads no cache,
so it is traced with ``config.use_cache`` off (the Graph's ``notes`` say so). What torch prints
while an export fails (graph dumps, symbolic-shape warnings) is dropped: the TraceError says it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import traceback
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind

from autopar.errors import TraceError
from autopar.ir.attention import fold_causal_masks, fuse_attention, unexpand_kv_heads
from autopar.ir.blocks import assign_layers, find_blocks
from autopar.ir.flops import count_flops
from autopar.ir.graph import Graph, Meta, Node, NodeRef, Role, TensorMeta
from autopar.ir.lookups import check_lookups
from autopar.ir.rewrites import keep_leading_dims

log = logging.getLogger("autopar")

_INPUT_ROLES = {
    InputKind.PARAMETER: Role.PARAMETER,
    InputKind.BUFFER: Role.BUFFER,
    InputKind.USER_INPUT: Role.INPUT,
    InputKind.CONSTANT_TENSOR: Role.CONSTANT,
    InputKind.CUSTOM_OBJ: Role.CONSTANT,
    InputKind.TOKEN: Role.CONSTANT,
}


_REUSED: dict | None = None  # while ``reusing_traces()`` is open: call key -> Graph


@contextlib.contextmanager
def reusing_traces():
    """Within it, a model traced again on a call like one traced before returns that graph, not a
    new trace: a dry run builds one model's programs once per simulated rank, and tracing a
    published model takes seconds each time. Alike: the model's class, its parameters' and
    buffers' names, shapes and dtypes, and the call's structure, tensor shapes, dtypes and devices
    and other values (so one model per scope: two models of one class and shapes would share)."""
    global _REUSED
    outer, _REUSED = _REUSED, {} if _REUSED is None else _REUSED
    try:
        yield
    finally:
        _REUSED = outer


def _call_key(model, example_inputs, example_kwargs):
    import torch.utils._pytree as pytree

    state = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in
                  list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)))
    leaves, spec = pytree.tree_flatten((example_inputs, example_kwargs))
    call = tuple((tuple(x.shape), str(x.dtype), x.device.type) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
    return type(model).__qualname__, state, str(spec), call


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
) -> Graph:
    """Export ``model`` called as ``model(*example_inputs, **example_kwargs)`` into a Graph.

    Raises TraceError (with torch's error as ``__cause__``) when torch.export cannot trace it.
    Inside ``reusing_traces()`` a call like one traced before returns that graph.
    """
    if isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    elif not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    key = _call_key(model, example_inputs, example_kwargs) if _REUSED is not None and name is None else None
    if key is not None and key in _REUSED:
        return _REUSED[key]
    example_inputs, example_kwargs = unalias((example_inputs, dict(example_kwargs or {})))
    # Source lines per node are never read here, and collecting them is a quarter of the trace.
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with _without_cache(model, example_kwargs) as notes, _stderr_kept_on_success():
            exported = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as exc:  # torch raises many types; all mean "could not trace"
        raise TraceError(explain_failure(model, exc)) from exc
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved
    keep_leading_dims(exported.graph_module)
    fuse_attention(exported)
    fold_causal_masks(exported)
    unexpand_kv_heads(exported)
    graph = from_exported(model, exported, name=name)
    graph.notes = tuple(notes)
    check_lookups(graph, model, example_inputs, example_kwargs)
    _release_weights(exported)
    if key is not None:
        _REUSED[key] = graph
    return graph


def _release_weights(exported) -> None:
    """Swap the exported program's copies of the model's weights for meta tensors: the Graph reads
    their shapes, never their values, and a parallelized module that kept them would hold a whole
    unsharded model on every rank for as long as it lives."""
    state = exported.state_dict
    for key, value in list(state.items()):
        meta = torch.empty_like(value, device="meta")
        state[key] = torch.nn.Parameter(meta, requires_grad=value.requires_grad) if isinstance(value, torch.nn.Parameter) else meta


@contextlib.contextmanager
def _without_cache(model, kwargs: dict):
    """A transformers model whose configs ask for a generation cache (the model's, and its
    submodules' own copies: T5's decoder keeps one), with it off for the trace (unless the call
    passes ``use_cache`` itself); yields the notes to keep."""
    notes: list[str] = []
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "use_cache", False) is True}
    if not configs or "use_cache" in kwargs:
        yield notes
        return
    for c in configs.values():
        c.use_cache = False
    notes.append(f"{type(model).__name__} traced with config.use_cache=False: its key/value cache is for "
                 "generation, and training reads none")
    log.info(notes[-1])
    try:
        yield notes
    finally:
        for c in configs.values():
            c.use_cache = True


@contextlib.contextmanager
def _stderr_kept_on_success():
    """What is written to stderr (file descriptor 2: torch's loggers and prints) inside the block,
    written out after it if it succeeds and dropped if it raises (torch dumps the partial graph
    before a data-dependent error; the TraceError says what failed and where)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (a notebook): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(fd)
        os.dup2(held.fileno(), fd)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            if ok:
                held.seek(0)
                text = held.read()
                if text:
                    os.write(fd, text)


def unalias(tree):
    """``tree`` with every input tensor that shares memory with an earlier one cloned. torch.export
    merges aliased inputs into one placeholder (``f(x, x)`` traces as ``f(b, b)``), so a model
    traced with ``labels=input_ids`` would later ignore its real labels: each input must be its
    own tensor in the trace."""
    import torch.utils._pytree as pytree

    seen: set = set()

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        fake = isinstance(x, torch._subclasses.fake_tensor.FakeTensor)
        key = id(x) if fake or x.is_meta or x.untyped_storage().data_ptr() == 0 else x.untyped_storage().data_ptr()
        if key in seen or id(x) in seen:
            return x.clone()
        seen.update((key, id(x)))
        return x

    return pytree.tree_map(fresh, tree)


def _check_static_shape(fx_node, model, names_of, root_type) -> None:
    """TraceError for an op whose output size depends on tensor values (``nonzero``, boolean-mask
    indexing, ``unique``: a mixture of experts routing tokens by their router scores). Plans and
    programs are built for fixed shapes."""
    vals = fx_node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    if not any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in vals):
        return
    path, _ = _module_of(fx_node, model, names_of.get(fx_node.name), root_type)
    raise TraceError(
        f"{target_name(fx_node.target)} in {path or root_type} makes a tensor whose size depends on tensor values "
        f"({fx_node.name}); autopar plans and runs fixed shapes. Write it with shapes known from the inputs' "
        "shapes: e.g. a mixture of experts can dispatch densely (every expert on every token, weighted by "
        "a one-hot or top-k mask) or with a fixed capacity per expert instead of boolean-mask indexing")


def from_exported(model: torch.nn.Module, exported: torch.export.ExportedProgram, *, name: str | None = None) -> Graph:
    """Build a Graph from an ExportedProgram of ``model`` (its original, un-exported module)."""
    sig = exported.graph_signature
    gm = exported.graph_module
    specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    user_outputs = _user_outputs(sig)
    params, param_names, dropped = _resolve_aliases(model, gm, specs, InputKind.PARAMETER, "named_parameters")
    buffers, buffer_names, dropped_b = _resolve_aliases(model, gm, specs, InputKind.BUFFER, "named_buffers")
    names_of = {**param_names, **buffer_names}  # placeholder name -> canonical fqn
    dropped |= dropped_b
    root_type = type(model).__name__

    nodes: dict[str, Node] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.name in dropped:
            continue
        inputs: list[str] = []
        args = _convert(fx_node.args, inputs)
        kwargs = _convert(dict(fx_node.kwargs), inputs)
        _check_static_shape(fx_node, model, names_of, root_type)
        meta = _meta_of(fx_node, gm)
        target = target_name(fx_node.target)
        path, mtype = _module_of(fx_node, model, names_of.get(fx_node.name), root_type)
        node = Node(
            name=fx_node.name,
            op=fx_node.op,
            target=target,
            inputs=inputs,
            args=args,
            kwargs=kwargs,
            meta=meta,
            flops=0,
            role=_role(fx_node, specs, user_outputs),
            module_path=path,
            module_type=mtype,
            param_name=names_of.get(fx_node.name),
            users=[u.name for u in fx_node.users],
            fx_node=fx_node,
        )
        if fx_node.op == "call_function":
            ins = [m for m in (nodes[i].meta for i in inputs if i in nodes) if isinstance(m, TensorMeta)]
            node.flops = count_flops(target, ins, meta)
        nodes[node.name] = node

    layers = assign_layers(nodes)
    return Graph(
        model_name=name or type(model).__name__,
        nodes=nodes,
        exported=exported,
        params=params,
        buffers=buffers,
        param_aliases=_aliases(model, "named_parameters") | _aliases(model, "named_buffers"),
        inputs=[n for n, s in specs.items() if s.kind == InputKind.USER_INPUT],
        outputs=list(user_outputs),
        layers=layers,
        blocks=find_blocks(nodes, layers),
    )


# ---- node fields ------------------------------------------------------------------------------
def target_name(target: Any) -> str:
    """``aten.mm.default``, ``operator.getitem``, ``higher_order.cond``; strings pass through."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = {"_operator": "operator", "builtins": ""}.get(target.__module__ or "", target.__module__ or "")
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{qualname}" if module else qualname


def _convert(value: Any, refs: list[str]) -> Any:
    """fx args -> same structure with NodeRefs; appends every referenced name to ``refs``."""
    if isinstance(value, torch.fx.Node):
        refs.append(value.name)
        return NodeRef(value.name)
    if isinstance(value, tuple):
        return tuple(_convert(v, refs) for v in value)
    if isinstance(value, list):
        return [_convert(v, refs) for v in value]
    if isinstance(value, dict):
        return {k: _convert(v, refs) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_convert(value.start, refs), _convert(value.stop, refs), _convert(value.step, refs))
    return value


def _meta_of(fx_node: torch.fx.Node, gm: torch.fx.GraphModule) -> Meta:
    val = fx_node.meta.get("val")
    if val is None and fx_node.op == "get_attr":
        val = getattr(gm, fx_node.target, None)
    if isinstance(val, torch.Tensor):
        return TensorMeta.of(val)
    if isinstance(val, (list, tuple)):
        return tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _role(fx_node: torch.fx.Node, specs: dict, user_outputs: dict[str, None]) -> Role:
    if fx_node.op == "placeholder":
        spec = specs.get(fx_node.name)
        return _INPUT_ROLES.get(spec.kind, Role.CONSTANT) if spec is not None else Role.INPUT
    if fx_node.op == "get_attr":
        return Role.CONSTANT
    if fx_node.op == "output" or fx_node.name in user_outputs:
        return Role.OUTPUT
    return Role.ACTIVATION


def _module_of(fx_node: torch.fx.Node, model: torch.nn.Module, fqn: str | None, root_type: str) -> tuple[str, str]:
    """(innermost module path, its class name)."""
    if fqn is not None:  # a parameter or buffer: the module that owns it
        path = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        try:
            return path, type(model.get_submodule(path)).__name__
        except AttributeError:
            return path, ""
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", root_type
    path, mtype = list(stack.values())[-1]
    path = re.sub(r"@\d+$", "", path)
    mtype = mtype if isinstance(mtype, str) else mtype.__qualname__
    return path, mtype.rsplit(".", 1)[-1]


def _user_outputs(sig) -> dict[str, None]:
    """Names of the user outputs, in order, without repeats (a dict used as an ordered set)."""
    return {
        s.arg.name: None for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT and hasattr(s.arg, "name")
    }


# ---- tied weights -----------------------------------------------------------------------------
def _aliases(model: torch.nn.Module, method: str) -> dict[str, tuple[str, ...]]:
    """canonical fqn -> every fqn of the same tensor, canonical (first registered) first."""
    groups: dict[int, list[str]] = {}
    for fqn, tensor in getattr(model, method)(remove_duplicate=False):
        if tensor is not None:
            groups.setdefault(id(tensor), []).append(fqn)
    return {names[0]: tuple(names) for names in groups.values()}


def _resolve_aliases(model, gm, specs, kind, method) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """For one kind (parameters or buffers): canonical fqn -> the placeholder that is read,
    placeholder -> canonical fqn, and the alias placeholders nothing reads (to leave out)."""
    canonical_of = {a: canon for canon, names in _aliases(model, method).items() for a in names}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    candidates: dict[str, list[str]] = {}
    for name, spec in specs.items():
        if spec.kind == kind:
            candidates.setdefault(canonical_of.get(spec.target, spec.target), []).append(name)
    chosen, names_of, dropped = {}, {}, set()
    for canon, names in candidates.items():
        used = [n for n in names if placeholders[n].users]
        keep = used or [next((n for n in names if specs[n].target == canon), names[0])]
        chosen[canon] = keep[0]
        names_of.update({n: canon for n in keep})
        dropped.update(n for n in names if n not in keep)
    return chosen, names_of, dropped


# ---- failures ---------------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


def explain_failure(model: torch.nn.Module, exc: BaseException) -> str:
    """TraceError message: the model class, torch's key line, where in the user's code, advice."""
    text = str(exc)
    headline = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    lines = [f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {headline[:400]}"]
    where = _source_line(text) or _user_frame(exc)
    if where:
        lines.append(f"  at {where}")
    lines.append(f"  try: {_advice(text, exc)}")
    lines.append("  (torch's full error is chained as __cause__)")
    return "\n".join(lines)


def _source_line(text: str) -> str | None:
    m = re.search(r"The following call raised this error:\s*\n\s*(File .*?)\n\s*(\S.*)", text)
    if m:
        return f"{m.group(1)}: {m.group(2).strip()}"
    m = re.search(r"# File: (\S+) in (\S+), code: (.+)", text)
    return f"{m.group(1)} in {m.group(2)}: {m.group(3).strip()}" if m else None


def _user_frame(exc: BaseException) -> str | None:
    """The deepest traceback frame outside torch, autopar.ir and the standard library."""
    best = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in traceback.extract_tb(exc.__traceback__):
            f = fr.filename
            if f.startswith((_TORCH_DIR, _HERE)) or f.startswith(os.path.dirname(os.__file__)) or f.startswith("<"):
                continue
            best = f'File "{f}", line {fr.lineno}, in {fr.name}: {(fr.line or "").strip()}'
        exc = exc.__cause__ or exc.__context__
    return best


def _advice(text: str, exc: BaseException) -> str:
    low = text.lower()
    if "data-dependent" in low or "guardondatadependent" in type(exc).__name__.lower():
        return (
            "replace data-dependent Python control flow (if/while on tensor values, .item(), "
            "int(tensor), shapes that depend on values) with torch.where / torch.cond, move it out "
            "of forward, or pass inputs that decide the branch with plain Python values (flags, "
            "sizes) instead of tensor contents"
        )
    if "numpy" in low or "tolist" in low or "tensor subclass" in low:
        return "keep forward in torch ops: no .numpy(), .tolist() or other conversions to Python data"
    return (
        "check that model(*example_inputs, **example_kwargs) runs eagerly with these inputs, then "
        "rewrite the failing line with plain torch ops that torch.export (non-strict) can trace"
    )
