"""The `autopar` command line. Subcommands hold no logic of their own: they call the library.

    autopar explain MODEL --mesh 2x4 [--cluster NAME|FILE] [--memory-budget 40GB] [--json F] [--profiled] [--code]
    autopar profile [--mesh 2x2] [--ops MODEL]
    autopar demo

MODEL is a built-in name (mlp, gpt, llama; `name:key=value,...` overrides its config) or
`pkg.module:factory`, where factory() returns (model, example_inputs) or
(model, example_inputs, example_kwargs). Bad arguments print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from autopar.errors import AutoparError, ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        print(f"autopar: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must look like 4 or 2x4, got {text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, got {text!r}")
    return shape


def load_model(spec: str):
    """(model, example_inputs, example_kwargs) from a built-in name or `pkg.module:factory`."""
    from autopar import models

    name, sep, opts = spec.partition(":")
    if sep and opts and "=" not in opts:  # pkg.module:factory
        mod_name, fn_name = name, opts
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load model factory {spec!r}: {e}") from None
        result = factory()
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            raise ConfigError(f"{spec} must return (model, example_inputs) or (model, example_inputs, example_kwargs)")
        model, inputs, *rest = result
        return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), rest[0] if rest else None
    overrides = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"model option {item!r} must look like key=value")
        overrides[key] = _literal(value)
    model, inputs = models.build(name, **overrides)
    return model, inputs, None


def _literal(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def cmd_explain(args) -> int:
    import autopar
    from autopar import ir

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ConfigError(f"cannot write the plan to {args.json!r}: its folder does not exist")
    model, inputs, kwargs = load_model(args.model)
    cluster, op_table = args.cluster, None
    if args.profiled:
        from autopar.cost_model.profile_comm import load_profile
        from autopar.cost_model.profile_ops import load_op_table

        prof = load_profile(args.mesh)
        if prof is None:
            raise ConfigError(f"no cached profile for mesh {'x'.join(map(str, args.mesh))}; run `autopar profile --mesh "
                              f"{'x'.join(map(str, args.mesh))}` first, or drop --profiled")
        cluster, op_table = prof.cluster, load_op_table("cpu")
    mesh = autopar.Mesh(args.mesh, cluster=cluster)
    pipeline = None if args.pipeline == "off" else "auto"
    graph = ir.trace(model, inputs, kwargs) if pipeline is None else None
    plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, memory_budget=args.memory_budget,
                        op_table=op_table, graph=graph, pipeline=pipeline)
    print(plan.explain())
    if args.code and plan.pipeline is not None:
        print("\n# --code: pipelined plans are not lowered yet")
    elif args.code:
        if graph is None:
            graph = ir.trace(model, inputs, kwargs)
        from autopar.codegen.lower import lower

        print("\n# the program every rank runs (its shard and groups are bound at run time)")
        print(lower(graph, plan, mesh).code)
    if args.json:
        try:
            plan.save(args.json)
        except OSError as e:
            raise ConfigError(f"cannot write the plan to {args.json!r}: {e.strerror or e}") from None
        print(f"\nplan written to {args.json}")
    return 0


def cmd_profile(args) -> int:
    from autopar.cli import profile

    return profile.run(args)


def cmd_demo(args) -> int:
    from autopar.cli import demo

    return demo.run(mesh_shape=args.mesh, model=args.model, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar", description="compiler-style auto-parallel planner for PyTorch")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    e = sub.add_parser("explain", help="plan a model on a mesh and print the plan, layer by layer")
    e.add_argument("model", help="built-in name (mlp, gpt, llama) or pkg.module:factory")
    e.add_argument("--mesh", type=parse_mesh, required=True, help="mesh shape, e.g. 8 or 2x4")
    e.add_argument("--cluster", default=None, help="preset (a100-80g, h100-80g, cpu-gloo) or JSON file")
    e.add_argument("--memory-budget", default=None, help="per-device memory, e.g. 40GB")
    e.add_argument("--json", default=None, help="also write the plan to this JSON file")
    e.add_argument("--pipeline", choices=("off", "auto"), default="off",
                   help="auto: also search pipeline stages (microbatches, schedule, sub-meshes); default off")
    e.add_argument("--code", action="store_true", help="also print the rewritten program a rank runs")
    e.add_argument("--profiled", action="store_true",
                   help="price with this machine's cached profiles (`autopar profile --mesh ...` / `--ops ...`)")
    e.set_defaults(func=cmd_explain)

    pr = sub.add_parser("profile", help="profile ops on this device, or collectives on a live CPU mesh")
    pr.add_argument("--mesh", type=parse_mesh, default=None, help="spawn this many local gloo ranks and fit alpha/beta per axis")
    pr.add_argument("--ops", default=None, help="time the ops of this model (built-in name or pkg.module:factory)")
    pr.set_defaults(func=cmd_profile)

    d = sub.add_parser("demo", help="the main job on a built-in model")
    d.add_argument("--model", default="gpt", help="built-in model name (default: gpt)")
    d.add_argument("--mesh", type=parse_mesh, default=(2, 2), help="mesh shape, e.g. 2x2 (default)")
    d.add_argument("--steps", type=int, default=5, help="AdamW steps (default: 5)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
