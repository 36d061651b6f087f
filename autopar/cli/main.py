"""The `autopar` command line. Subcommands hold no logic of their own: they call the library.

    autopar explain MODEL --mesh 2x4 [--cluster NAME|FILE] [--memory-budget 40GB] [--json F] [--profiled] [--code]
    autopar dry-run MODEL --mesh 128x8 [planning flags] [--plan FILE] [--ranks all|0,7,...] [--json F]
    autopar profile [--mesh 2x2] [--ops MODEL]
    autopar demo

MODEL is a built-in name (mlp, gpt, llama; `name:key=value,...` overrides its config) or
`pkg.module:factory`, where factory() returns (model, example_inputs) or
(model, example_inputs, example_kwargs). Bad arguments print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from autopar.cli.model_spec import load_model, parse_options
from autopar.errors import AutoparError, ConfigError
from autopar.solver.units import fmt_bytes, fmt_s, parse_bytes


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


def _is_plan_file(model: str) -> bool:
    return model.endswith(".json") and not model.startswith("hf:")


def _make_plan(args):
    """(plan, graph or None, model, inputs, kwargs, mesh with its cluster, PlanConfig) for
    ``explain``/``plan``'s arguments."""
    import autopar
    from autopar import ir

    if args.mesh is None:
        raise ConfigError("--mesh is required to plan a model (e.g. --mesh 2x4)")
    model, inputs, kwargs = load_model(args.model)
    config = planning_config(args)
    if getattr(args, "profiled", False):
        from autopar.cost_model.profile_comm import load_profile
        from autopar.cost_model.profile_ops import load_op_table

        prof = load_profile(args.mesh)
        if prof is None:
            raise ConfigError(f"no cached profile for mesh {'x'.join(map(str, args.mesh))}; run `autopar profile --mesh "
                              f"{'x'.join(map(str, args.mesh))}` first, or drop --profiled")
        config = config.replace(cluster=prof.cluster, op_table=load_op_table("cpu"))
    _warn_cpu_pricing(args.model, config.cluster)
    mesh = autopar.Mesh(args.mesh)
    graph = ir.trace(model, inputs, kwargs) if config.pipeline is None else None
    plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, graph=graph, config=config)
    if config.cluster is not None:
        mesh = mesh.with_cluster(config.cluster)
    return plan, graph, model, inputs, kwargs, mesh, config.replace(cluster=None)


def planning_config(args):
    """The ``autopar.PlanConfig`` of the command line's flags (every ``USER_OPTIONS`` field)."""
    from autopar.solver.config import PlanConfig
    from autopar.solver.layout import Layout

    force = None
    if args.layout:
        degrees = parse_options(args.layout)
        unknown = sorted(set(degrees) - {"dp", "tp", "zero"})
        if unknown:
            raise ConfigError(f"--layout takes dp=, tp= and zero=, e.g. dp=2,tp=4,zero=2; got {', '.join(unknown)}")
        force = Layout(**{k: int(v) for k, v in degrees.items()})
    return PlanConfig(
        memory_budget=args.memory_budget if args.memory_budget is not None else "auto",
        cluster=args.cluster,
        pipeline=_pipeline_option(args.pipeline),
        force=force,
        optimizer=args.optimizer,
        idle_axes=_axes_option(args.idle_axes, "--idle-axes"),
        identical_axes=_axes_option(args.identical_axes, "--identical-axes"),
        bucket_bytes=int(parse_bytes(args.bucket_size)),
        time_limit_s=args.time_limit,
        solver=args.solver,
        precision=args.precision,
    )


def _pipeline_option(text: str):
    """"auto", "off" or fixed fields such as "stages=4,schedule=1f1b,microbatches=8"."""
    from autopar.solver.config import Pipeline

    if text in ("auto", "off"):
        return "auto" if text == "auto" else None
    fields = parse_options(text)
    try:
        return Pipeline(**fields)
    except TypeError as err:
        raise ConfigError(f"--pipeline {text!r}: {err}; fields are stages, schedule, microbatches, virtual_stages, "
                          "recompute") from None


def _axes_option(text: str, flag: str):
    if text == "auto":
        return "auto"
    if text == "none":
        return ()
    try:
        return tuple(int(a) for a in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} takes auto, none or mesh axes such as 0,1; got {text!r}") from None


def _warn_cpu_pricing(model: str, cluster) -> None:
    """One line where a published shape (a model trained on GPUs) is priced on the CPU preset."""
    from autopar import models

    name = model.partition(":")[0]
    if name in models.PUBLISHED and cluster in (None, "cpu-gloo"):
        print(f"autopar: {name} is priced on the cpu-gloo preset (gloo on a few CPU cores); pass --cluster a100-80g "
              "or --cluster h100-80g for GPU figures", file=sys.stderr)


def _save(plan, path) -> None:
    try:
        plan.save(path)
    except OSError as e:
        raise ConfigError(f"cannot write the plan to {path!r}: {e.strerror or e}") from None


def _check_folder(path) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConfigError(f"cannot write the plan to {path!r}: its folder does not exist")


def cmd_explain(args) -> int:
    from autopar import ir
    from autopar.solver.plan import Plan

    _check_folder(args.json)
    if _is_plan_file(args.model):  # a saved plan: explain it as it is
        plan = Plan.load(args.model)
        print(plan.explain(all=args.all))
        if args.html:
            _write_html(plan, None, args.html)
        return 0
    if args.compare and args.mesh:  # a bad configuration fails before anything is planned
        import autopar
        from autopar.solver.compare import check_configs

        check_configs(args.compare, autopar.Mesh(args.mesh))
    plan, graph, model, inputs, kwargs, mesh, config = _make_plan(args)
    print(plan.explain(all=args.all))
    if args.code and plan.pipeline is not None:
        for st, stage, lowered in _stage_programs(plan, model, inputs, kwargs):
            who = f"rank {stage.ranks[0]}" if len(stage.ranks) == 1 else f"ranks {stage.ranks[0]}-{stage.ranks[-1]}"
            print(f"\n# stage {st}: the program {who} run(s) for each microbatch (shards and groups bound at run time)")
            print(lowered.code)
    elif args.code:
        from autopar.codegen.lower import lower

        if graph is None:
            graph = ir.trace(model, inputs, kwargs)
        print("\n# the program every rank runs (its shard and groups are bound at run time)")
        print(lower(graph, plan, mesh).code)
    rows = None
    if args.compare:
        from autopar.solver.compare import compare, table

        rows = compare(model, mesh, inputs, args.compare, plan=plan, example_kwargs=kwargs,
                       memory_budget=plan.solver.get("memory_budget"), plan_config=config)
        print("\nwhat-ifs, priced by the same cost model:")
        print(table(rows))
    if args.html:
        _write_html(plan, rows, args.html)
    if args.json:
        _save(plan, args.json)
        print(f"\nplan written to {args.json}")
    return 0


def _write_html(plan, rows, path) -> None:
    from autopar.solver.report import html_report

    _check_folder(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html_report(plan, rows))
    except OSError as e:
        raise ConfigError(f"cannot write the report to {path!r}: {e.strerror or e}") from None
    print(f"\nreport written to {path}")


def cmd_plan(args) -> int:
    _check_folder(args.output)
    plan = _make_plan(args)[0]
    _save(plan, args.output)
    s = plan.summary()
    stages = len(s["pipeline"]["stages"])
    print(f"plan written to {args.output}: predicted step {fmt_s(s['step_time_s'])}, "
          f"{fmt_bytes(s['memory_bytes_per_device'])} per device, {stages} stage(s)")
    return 0


def cmd_diff(args) -> int:
    from autopar.solver.plan import Plan

    a, b = Plan.load(args.a), Plan.load(args.b)
    print("\n".join(a.diff(b).lines()))
    return 0


def cmd_dry_run(args) -> int:
    """Plan (or read ``--plan``), run the sampled ranks' programs on meta tensors and a fake process
    group, print what each ran; exit 0 only when every collective matched and memory is within
    the tolerance of the prediction, 1 otherwise."""
    import json

    from autopar.compose.dry_run import dry_run
    from autopar.solver.plan import Plan

    _check_folder(args.json)
    ranks = None if args.ranks is None else ("all" if args.ranks == "all" else _rank_list(args.ranks))
    if args.plan is not None:
        model, inputs, kwargs = load_model(args.model)
        plan = Plan.load(args.plan)
    else:
        plan, _, model, inputs, kwargs, _, _ = _make_plan(args)
    if not args.quiet:
        print(f"dry run of {'all ranks' if ranks == 'all' else 'the sampled ranks' if ranks is None else 'ranks ' + args.ranks}"
              f" of {plan.mesh_obj.size}", file=sys.stderr)
    progress = None if args.quiet else (lambda r: print(f"  rank {r.rank}: {r.ops} ops, {len(r.step_collectives)} collectives a "
                                                          f"step, peak {fmt_bytes(r.peak_bytes)} ({r.seconds:.1f} s)",
                                                          file=sys.stderr))
    result = dry_run(plan, model, inputs, example_kwargs=kwargs, ranks=ranks, optimizer=args.optimizer, progress=progress)
    print(result.report(verbose=args.verbose))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result.to_json(), f)
        except OSError as e:
            raise ConfigError(f"cannot write the dry run to {args.json!r}: {e.strerror or e}") from None
    return 0 if result.ok else 1


def _rank_list(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise ConfigError(f"--ranks takes all or ranks such as 0,7,1023; got {text!r}") from None


def cmd_profile(args) -> int:
    from autopar.cli import profile

    return profile.run(args)


def cmd_demo(args) -> int:
    from autopar.cli import demo

    return demo.run(mesh_shape=args.mesh, model=args.model, steps=args.steps)


def progress_handler(stream, quiet: bool):
    """A logging handler that shows autopar's progress on ``stream``: only on a terminal and
    without ``--quiet`` (None otherwise)."""
    import logging

    if quiet or not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("autopar: %(message)s"))
    return handler


def _stage_programs(plan, model, inputs, kwargs):
    """(stage index, StagePlan, Lowered) per stage of a pipelined plan: the microbatch graph cut
    into stages and each lowered on its sub-mesh, receiving what the previous stages send, as
    ``parallelize`` builds them."""
    import autopar
    from autopar import ir
    from autopar.codegen.stages import cut_stages, lower_stage, sent_specs
    from autopar.solver.microbatches import microbatch_inputs
    from autopar.solver.receives import with_received

    mb_args, mb_kwargs = microbatch_inputs(inputs, kwargs, plan.pipeline.microbatches)
    micro = ir.trace(model, mb_args, mb_kwargs or None)
    plan = with_received(plan, micro)  # a plan file of schema version 3 or older has no receiving steps
    cuts = cut_stages(micro, plan)
    specs = sent_specs(micro, plan, cuts)
    for st, stage in enumerate(plan.pipeline.stages):
        yield st, stage, lower_stage(micro, plan, cuts, specs, st, autopar.Mesh.from_dict(stage.plan.mesh))


def _planning_arguments(parser) -> None:
    """The flags of ``autopar.PlanConfig``'s options (``planning_config`` reads them)."""
    parser.add_argument("--mesh", type=parse_mesh, default=None, help="mesh shape, e.g. 8 or 2x4 (needed unless MODEL is a plan file)")
    parser.add_argument("--cluster", default=None, help="preset (a100-80g, h100-80g, cpu-gloo; default cpu-gloo) or JSON file")
    parser.add_argument("--memory-budget", default=None,
                        help="per-device memory, e.g. 40GB (default: a GPU preset's device memory; none on cpu-gloo)")
    parser.add_argument("--pipeline", default="auto", metavar="auto|off|FIELDS",
                        help="auto (default): also search pipeline stages (microbatches, schedule, sub-meshes); off: one "
                        "stage; or fixed fields, e.g. stages=4,schedule=1f1b,microbatches=8")
    parser.add_argument("--layout", default=None, metavar="dp=,tp=,zero=",
                        help="plan this hand-style layout, e.g. dp=2,tp=4,zero=2 (autopar.Layout)")
    parser.add_argument("--optimizer", default="adamw", help="optimizer whose states are priced: adamw (default), adam, "
                        "sgd_momentum, sgd")
    parser.add_argument("--idle-axes", default="auto", help="mesh axes the plan may leave unused: auto (default), none, or 0,1")
    parser.add_argument("--identical-axes", default="auto",
                        help="axes with whole (Megatron-style) gradients of replicated values: auto (default), none, or 0,1")
    parser.add_argument("--bucket-size", default="25MiB", help="the gradient reducer's bucket size (default 25MiB)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="the ILP solver's time limit in seconds (default 60)")
    parser.add_argument("--solver", default=None, choices=("highs", "cbc"), help="ILP solver (default: HiGHS where installed)")
    parser.add_argument("--precision", default=None, choices=("bf16", "fp16", "fp32"),
                        help="mixed precision: 16-bit compute on fp32 masters (default: the model's own dtypes)")
    parser.add_argument("--profiled", action="store_true",
                        help="price with this machine's cached profiles (`autopar profile --mesh ...` / `--ops ...`)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (they show only on a terminal)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar", description="compiler-style auto-parallel planner for PyTorch")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    e = sub.add_parser("explain", help="plan a model on a mesh and print the plan, layer by layer")
    e.add_argument("model", help="built-in name (mlp, gpt, llama), published shape (gpt3-175b, llama3-8b, ...), "
                   "hf:path/to/config.json, pkg.module:factory, or a plan file (plan.json)")
    _planning_arguments(e)
    e.add_argument("--json", default=None, help="also write the plan to this JSON file")
    e.add_argument("--code", action="store_true", help="also print the rewritten program a rank runs")
    e.add_argument("--all", action="store_true", help="also list views, reshapes and getitems in the per-layer table")
    e.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML report")
    e.add_argument("--compare", nargs="+", default=None, metavar="CONFIG",
                   help='hand-written configurations to price beside the plan, e.g. "tp=8,dp=16" "tp=8,pp=4,dp=4,mb=16"')
    e.set_defaults(func=cmd_explain)

    pl = sub.add_parser("plan", help="plan a model on a mesh and write the plan to a JSON file")
    pl.add_argument("model", help="as for explain")
    _planning_arguments(pl)
    pl.add_argument("-o", "--output", required=True, help="the plan file to write")
    pl.set_defaults(func=cmd_plan)

    df = sub.add_parser("diff", help="what differs between two plan files, and what each change costs")
    df.add_argument("a")
    df.add_argument("b")
    df.set_defaults(func=cmd_diff)

    dr = sub.add_parser("dry-run", help="build and run sampled ranks' programs on fake tensors and a fake process group: "
                        "every collective checked against its peers, memory against the plan")
    dr.add_argument("model", help="as for explain (the model the plan is for)")
    _planning_arguments(dr)
    dr.add_argument("--plan", default=None, metavar="FILE", help="run this plan file instead of planning")
    dr.add_argument("--ranks", default=None, metavar="all|R,R,...",
                    help="ranks to run (default: first and last of every pipeline stage and the mesh corners)")
    dr.add_argument("--verbose", action="store_true", help="list every sampled rank's collectives by group")
    dr.add_argument("--json", default=None, help="also write every rank's record to this JSON file")
    dr.set_defaults(func=cmd_dry_run)

    pr = sub.add_parser("profile", help="profile ops on this device, or collectives on a live CPU mesh")
    pr.add_argument("--mesh", type=parse_mesh, default=None, help="spawn this many local gloo ranks and fit alpha/beta per axis")
    pr.add_argument("--ops", default=None, help="time the ops of this model (built-in name or pkg.module:factory)")
    pr.set_defaults(func=cmd_profile)

    d = sub.add_parser("demo", help="the main job on a built-in model")
    d.add_argument("--model", default="gpt", help="built-in model name (default: gpt)")
    d.add_argument("--mesh", type=parse_mesh, default=(2, 2), help="mesh shape, e.g. 2x2 (default)")
    d.add_argument("--steps", type=int, default=20, help="AdamW steps (default: 20)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    import logging

    parser = build_parser()
    args = parser.parse_args(argv)
    handler = progress_handler(sys.stderr, getattr(args, "quiet", False))
    logger = logging.getLogger("autopar")
    if handler is not None:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        return args.func(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    finally:
        if handler is not None:
            logger.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
