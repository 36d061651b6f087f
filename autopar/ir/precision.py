"""Mixed precision: what a plan computes in and what it keeps.

``MixedPrecision(param_dtype, reduce_dtype, master_dtype)`` is the recipe large models train with
(Megatron's distributed optimizer, Colossal-AI's ``precision="bf16"``, FSDP2's
``MixedPrecisionPolicy``): the forward and backward run on a ``param_dtype`` working copy of the
parameters (buffers and floating inputs cast alike, as ``model.to(param_dtype)`` runs); the
optimizer sees ``master_dtype`` masters, which its states follow; gradients reach the masters
summed in ``reduce_dtype``.

The planner traces the model as it computes (``working_call``: a weightless copy in the working
dtype, floating inputs cast alike), so the graph, its prices and the programs lowered from it are
16-bit; the runtime keeps what ``kept_dtype`` says and casts the masters into the program
(``autopar.runtime.module``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree

from autopar.errors import ConfigError

NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
         "fp32": torch.float32, "float32": torch.float32}
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``, sum gradients across ranks in ``reduce_dtype`` (fp32 by default:
    exact sums; bf16 halves the bytes, as FSDP2's ``reduce_dtype``), keep masters, their gradients
    and the optimizer's states in ``master_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, str):
                value = NAMES.get(value.lower(), value)
                object.__setattr__(self, field.name, value)
            if value not in FLOATS:
                raise ConfigError(f"MixedPrecision({field.name}={value!r}): use a floating dtype "
                                  f"(torch.bfloat16, torch.float16, torch.float32)")
        if torch.finfo(self.master_dtype).bits < torch.finfo(self.param_dtype).bits:
            raise ConfigError(f"MixedPrecision(master_dtype={self.master_dtype}) is narrower than the working dtype "
                              f"{self.param_dtype}: masters keep at least the working copy's precision")

    @property
    def name(self) -> str:
        short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
        return (f"{short[self.param_dtype]} compute, {short[self.master_dtype]} masters"
                if self.param_dtype != self.master_dtype else f"{short[self.param_dtype]}")

    @property
    def casts(self) -> bool:
        """Whether the working copy differs from the masters (a cast in every forward)."""
        return self.param_dtype != self.master_dtype

    def to_dict(self) -> dict:
        return {k: str(getattr(self, k)).removeprefix("torch.") for k in ("param_dtype", "reduce_dtype", "master_dtype")}

    @classmethod
    def from_dict(cls, d: dict) -> MixedPrecision:
        return cls(**{k: getattr(torch, v) for k, v in d.items()})


def policy(precision) -> MixedPrecision | None:
    """The ``MixedPrecision`` of a ``precision`` option: None (the model's own dtypes, nothing
    cast), "bf16" / "fp16" (16-bit compute, fp32 masters), "fp32" (everything fp32), or a
    ``MixedPrecision``."""
    if precision is None or isinstance(precision, MixedPrecision):
        return precision
    if isinstance(precision, str) and precision.lower() in NAMES:
        dtype = NAMES[precision.lower()]
        return MixedPrecision(dtype, torch.float32, torch.float32)
    raise ConfigError(f"precision={precision!r}: use None (the model's own dtypes), 'bf16', 'fp16', 'fp32' or "
                      "autopar.MixedPrecision(param_dtype, reduce_dtype, master_dtype)")


def kept_dtype(dtype: torch.dtype, parameter: bool, precision: MixedPrecision | None) -> torch.dtype:
    """The dtype a parallelized module keeps a tensor of ``dtype`` in under ``precision``: a
    floating parameter in the master dtype (what the optimizer updates), a floating buffer in the
    working dtype (as the program reads it, like ``model.to(dtype)``), anything else as it is."""
    if precision is None or not dtype.is_floating_point:
        return dtype
    return precision.master_dtype if parameter else precision.param_dtype


def cast_floats(tree, dtype: torch.dtype):
    """``tree`` with every floating tensor in ``dtype`` (the others as they are)."""
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def working_model(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A weightless copy of ``model``: its parameters and buffers are fake tensors (shapes, dtypes
    and devices, no memory; tied parameters stay tied), the floating ones in ``dtype`` when given.
    For tracing the model again (in another mode, at other shapes, as it computes in ``dtype``);
    ``fake_inputs`` makes a call's inputs alike. Fake rather than meta: a model whose code branches
    on its device (transformers' Mixtral counts tokens per expert in float32 on CPU, in int32
    elsewhere) traces the branch it runs. The model itself is not changed."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict = {}

    def fake(t):
        f = mode.from_tensor(t.detach())
        return f.to(dtype) if dtype is not None and f.is_floating_point() else f

    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake(b)
    try:
        copied = copy.deepcopy(model, memo)
    except Exception as err:  # a module holding something deepcopy refuses (a lock, a file)
        raise ConfigError(
            f"cannot keep a weightless copy of {type(model).__name__} for tracing ({type(err).__name__}: {err}); "
            "call the parallelized model only in the mode and with the input shapes it was parallelized for"
        ) from None
    object.__setattr__(copied, "_autopar_fake_mode", mode)
    object.__setattr__(copied, "_autopar_dtype", dtype)
    return copied


def fake_inputs(skeleton: torch.nn.Module, tree):
    """``tree`` with every tensor a fake of it in ``skeleton``'s fake mode (``working_model``),
    the floating ones in its dtype."""
    mode = skeleton._autopar_fake_mode
    tree = pytree.tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake(x) else x, tree)
    dtype = skeleton._autopar_dtype
    return tree if dtype is None else cast_floats(tree, dtype)


def working_call(model: torch.nn.Module, call, precision: MixedPrecision):
    """(``working_model`` of ``model`` in the working dtype, ``call`` = (inputs, kwargs) made alike
    by ``fake_inputs``): the call the planner traces. A model already in that form is kept."""
    dtype = precision.param_dtype
    done = getattr(model, "_autopar_dtype", None) == dtype
    working = model if done else working_model(model, dtype)
    return working, fake_inputs(working, call)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
