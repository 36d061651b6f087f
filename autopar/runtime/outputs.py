"""Outputs a call returns split over ranks, gathered when they are first read.

A training step reads the loss; a language model also returns its logits (batch x sequence x
vocabulary: 196 MiB for GPT-2 at batch 8 x 128), which a data-parallel plan holds split over the
batch. Making them whole on every rank on every call (as the model's own call would have them) is an
all-gather of the whole tensor, which on gloo took longer than the step itself. So a call returns such
an output as a ``SplitOutput``: a tensor of the whole output's shape and dtype that holds this rank's
piece, and gathers the rest from the other ranks the first time an op reads it. Unread, it costs
nothing; read, it is the same tensor the model returns, and gradients flow through it as through any
output (to this rank's piece: every rank reads the same whole value, so its gradient is whole on every
rank and each keeps its block of it).

The gather is collective: every rank that holds a piece must read the output too, at the same point
of its program, as any ``torch.distributed`` call (code that reads the logits on rank 0 alone,
``if rank == 0: print(out.logits.argmax(-1))``, must read them on every rank). Before it gathers, a
rank checks on a group of its own (``ReadCheck``) that every rank is reading the same output of the
same call; a rank that is not raises ``ConfigError`` on the ranks that are, when the group's
timeout runs out, instead of pairing one rank's gather with another's collective.

What does not dispatch reads nothing: ``shape``, ``dtype``, ``device``, ``requires_grad``, ``grad_fn``.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from autopar.errors import ConfigError

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class SplitOutput(torch.Tensor):
    """An output of the whole ``shape``, gathered on first read (module docstring): ``gather()``
    returns the whole tensor; ``whole()`` calls it once and keeps the result."""

    __slots__ = ("_gather", "_whole")

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device, gather: Callable[[], torch.Tensor]):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t._gather, t._whole = gather, None
        return t

    def whole(self) -> torch.Tensor:
        """The whole output as a plain tensor (gathered on the first call)."""
        if self._whole is None:
            with torch.no_grad():
                whole = self._gather()
            if tuple(whole.shape) != tuple(self.shape) or whole.dtype != self.dtype:
                raise ConfigError(f"a split output gathered as {whole.dtype} {tuple(whole.shape)}, not {self.dtype} "
                                  f"{tuple(self.shape)}")
            self._whole, self._gather = whole, None
        return self._whole

    def take_gather(self) -> Callable[[], torch.Tensor]:
        """The gather of an output not read yet, taken away (another SplitOutput takes its place)."""
        gather, self._gather = self._gather, None
        if gather is None:
            raise ConfigError("this split output was read or handed on already")
        return gather

    @property
    def gathered(self) -> bool:
        return self._whole is not None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = []

        def unwrap(t: "SplitOutput") -> torch.Tensor:
            wrappers.append(t)
            return t.whole()

        args = tree_map_only(SplitOutput, unwrap, args)
        kwargs = tree_map_only(SplitOutput, unwrap, kwargs or {})
        out = func(*args, **kwargs)
        for t in wrappers:  # an in-place op returns the tensor it wrote: hand back the output itself
            if out is t._whole:
                return t
        return out

    # numpy, lists and pickles read the data without dispatching: gather first
    def numpy(self, *args, **kwargs):
        return self.whole().numpy(*args, **kwargs)

    def tolist(self):
        return self.whole().tolist()

    def __array__(self, *args, **kwargs):
        return self.whole().__array__(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.whole().detach().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.whole())


class _Returned(torch.autograd.Function):
    """A program's piece of an output -> the ``SplitOutput`` of the whole; backward: this rank's
    block of the whole gradient (``block``: its slices)."""

    @staticmethod
    def forward(ctx, piece, shape, gather, block):
        ctx.block = block
        ctx.set_materialize_grads(False)
        return SplitOutput(shape, piece.dtype, piece.device, gather)

    @staticmethod
    def backward(ctx, grad):
        return block_of(grad, ctx.block), None, None, None


def block_of(grad, block):
    """This rank's ``block`` (slices) of a whole gradient (None: none)."""
    if grad is None:
        return None
    if isinstance(grad, SplitOutput):
        grad = grad.whole()
    return grad[block].contiguous()


def returned_split(piece: torch.Tensor, shape, gather, block) -> torch.Tensor:
    """``piece`` (this rank's ``block`` of a whole output of ``shape``) returned as the whole
    output, gathered by ``gather(piece)`` on first read, with the gradient of its block."""
    piece = piece.detach() if not (piece.requires_grad and torch.is_grad_enabled()) else piece
    bound = (lambda p: lambda: gather(p))(piece.detach())
    if piece.requires_grad:
        return _Returned.apply(piece, tuple(shape), bound, block)
    return SplitOutput(shape, piece.dtype, piece.device, bound)


class ReadCheck:
    """Checks that every rank of a module reads the same split output of the same call before the
    ranks gather it: an all-gather of (module, call, output) on a gloo group of the module's ranks
    made for it alone. Make it on every rank in the same order (``dist.new_group`` is collective)."""

    _modules = itertools.count()

    def __init__(self, ranks, timeout=None):
        ranks = sorted(int(r) for r in ranks)
        # host tensors over gloo whatever the world runs (a fake world for a dry run: its own backend)
        backend = None if "fake" in dist.get_backend() else "gloo"
        self.pg = dist.new_group(ranks=ranks, backend=backend, timeout=timeout) if len(ranks) > 1 else None
        self.module = next(ReadCheck._modules)
        self.ranks = ranks
        self.timeout = timeout

    def agree(self, call: int, index: int, name: str) -> None:
        """Return once every rank is reading output ``index`` of call ``call``; ConfigError when a
        rank reads another one, or none within the group's timeout."""
        if self.pg is None:
            return
        mine = torch.tensor([self.module, call, index], dtype=torch.int64)
        everyone = torch.empty(len(self.ranks) * 3, dtype=torch.int64)
        try:
            _all_gather_into(everyone, mine, group=self.pg)
        except RuntimeError as err:
            raise ConfigError(
                f"this rank read {name} (output {index} of call {call}), which the plan returns split over ranks and "
                f"gathers when it is first read, and not every rank read it within the timeout ({self.timeout}): "
                "read a split output on every rank at the same point (like any collective), or not at all "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        differ = [(r, tuple(row)) for r, row in zip(self.ranks, everyone.view(-1, 3).tolist()) if tuple(row) != tuple(mine.tolist())]
        if differ:
            said = "; ".join(f"rank {r} read output {i} of call {c}" for r, (_, c, i) in differ[:4])
            raise ConfigError(
                f"this rank read {name} (output {index} of call {call}) while {said}: outputs returned split over ranks "
                "are gathered when first read, by every rank together; read them on every rank in the same order")


def output_names(out_spec, n: int) -> list[str]:
    """How the caller reaches each of ``n`` flat outputs (``.logits``, ``[1]``), for messages."""
    from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

    try:
        paths = [keystr(path) for path, _ in tree_flatten_with_path(tree_unflatten(list(range(n)), out_spec))[0]]
    except (ValueError, TypeError):
        paths = []
    return paths if len(paths) == n else [f"output {i}" for i in range(n)]


def split_returned(flat: list, returned: dict, groups, check: ReadCheck, call: int, names: list[str]) -> list:
    """A program's flat outputs with each one it returns split (``Lowered.returned``: index ->
    spec) as a ``SplitOutput`` that ``groups`` gather whole when it is first read."""
    from autopar.codegen.ops import gather_full

    if not returned:
        return flat
    out = list(flat)
    for i, spec in returned.items():
        def gather(piece, i=i, spec=spec):
            check.agree(call, i, names[i])
            return gather_full(piece, spec, groups)

        out[i] = returned_split(out[i], spec.shape, gather, spec.local_slices(groups.mesh, groups.rank))
    return out
