"""Strategy rules by op family, and the lookup over them: importing this package registers every
rule (``strategy.register``), and ``strategies_for`` answers for a node (see ``strategy``'s docstring:
the replicated fallback, in-place twins)."""
from __future__ import annotations

import logging
from typing import Iterable

from autopar.sharding_spec.rules import (  # noqa: F401  (registers the rules)
    attention,
    constant,
    conv,
    embedding,
    index,
    loss,
    matmul,
    norm,
    pointwise,
    reduction,
    scatter,
    view,
)
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import OpContext, Strategy, replicate_strategy, rule_of

log = logging.getLogger("autopar")
_WARNED: set[str] = set()


def has_rule(target: str) -> bool:
    return rule_of(target) is not None


def strategies_for(ctx: OpContext) -> list[Strategy]:
    """The candidate strategies of one node; the replicated fallback for ops without a rule."""
    target = ctx.node.target
    rule = rule_of(target)
    if rule is None:
        if target not in _WARNED:
            _WARNED.add(target)
            log.info("no sharding rule for %s; it runs replicated on every device", target)
        return [replicate_strategy(ctx)]
    out = [s for s in rule(ctx) if _even(s, ctx.mesh.shape)]
    # Always keep the replicated strategy: it is valid for every op and a safe fallback.
    rep = replicate_strategy(ctx)
    if rep not in out:
        out.append(rep)
    return _dedupe(out)


def _even(s: Strategy, mesh_shape) -> bool:
    specs = [x for x in s.inputs if x is not None]
    out = s.output
    if isinstance(out, ShardingSpec):
        specs.append(out)
    elif isinstance(out, tuple):
        specs += [o for o in out if o is not None]
    return all(x.is_even(mesh_shape) for x in specs)


def _dedupe(strategies: Iterable[Strategy]) -> list[Strategy]:
    seen, out = set(), []
    for s in strategies:
        key = (s.inputs, s.output)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
