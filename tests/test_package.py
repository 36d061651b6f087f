"""The package surface: subpackages reachable after a plain ``import autopar``, imported lazily.

Each check runs in a fresh interpreter, so modules this test process (or an earlier test) already
imported cannot make a missing attribute look present.
"""
import subprocess
import sys
import textwrap

import pytest

SUBPACKAGES = ["cli", "codegen", "cost_model", "ir", "models", "runtime", "sharding_spec", "solver"]


def run_fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_models_build_after_a_plain_import():
    out = run_fresh("""
        import autopar
        model, inputs = autopar.models.build("gpt")
        print(type(model).__name__, len(inputs))
    """)
    assert out.split() == ["GPT", "2"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_is_an_attribute(name):
    out = run_fresh(f"""
        import autopar, importlib
        mod = autopar.{name}
        assert mod is importlib.import_module("autopar.{name}"), mod
        assert "{name}" in dir(autopar)
        print(mod.__name__)
    """)
    assert out.strip() == f"autopar.{name}"


def test_import_loads_neither_runtime_nor_codegen():
    out = run_fresh("""
        import sys
        import autopar
        autopar.models.build("mlp")
        autopar.ir, autopar.solver, autopar.cost_model, autopar.sharding_spec
        print(sorted(m for m in sys.modules if m.startswith(("autopar.runtime", "autopar.codegen", "autopar.cli"))))
    """)
    assert out.strip() == "[]"


def test_the_documented_entry_points_are_unchanged():
    out = run_fresh("""
        import autopar
        from autopar import models
        from autopar.compose.parallelize import parallelize
        assert models is autopar.models
        assert autopar.parallelize is parallelize and autopar.plan is autopar.solver.api.plan
        assert autopar.Mesh((2,)).size == 2
        from autopar.cluster import ClusterSpec
        assert autopar.ClusterSpec is ClusterSpec and autopar.cost_model.ClusterSpec is ClusterSpec
        assert autopar.compare is autopar.solver.compare.compare_plan
        assert autopar.plan_reshard is autopar.solver.reshard_search.plan_reshard
        print("ok")
    """)
    assert out.strip() == "ok"


def test_plan_parallelize_and_the_cli_share_one_config():
    """``plan``, ``parallelize`` and the CLI take one ``PlanConfig``: as ``config=`` or its fields as
    keywords; the CLI's flags build one whose defaults are the config's; an unknown option or a
    bad value is a ConfigError naming what to use."""
    import dataclasses
    import inspect

    import autopar
    from autopar.cli.main import build_parser, planning_config
    from autopar.solver.config import OPTION_NAMES, USER_OPTIONS

    for fn in (autopar.plan, autopar.parallelize):
        params = inspect.signature(fn).parameters
        assert params["config"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert not set(params) & set(OPTION_NAMES), "an option spelled twice"
    assert all(f.kw_only for f in dataclasses.fields(autopar.PlanConfig))
    assert "memory_budget" in autopar.PlanConfig.__doc__ and "PlanConfig" in autopar.parallelize.__doc__
    defaults = autopar.PlanConfig()
    args = build_parser().parse_args(["plan", "gpt", "--mesh", "4", "-o", "p.json"])
    assert planning_config(args) == defaults  # the CLI's defaults are the config's
    args = build_parser().parse_args(["plan", "gpt", "--mesh", "2x2", "-o", "p.json", "--layout", "dp=2,tp=2,zero=2",
                                      "--pipeline", "stages=2,schedule=1f1b", "--idle-axes", "none",
                                      "--memory-budget", "40GB", "--bucket-size", "4MiB", "--optimizer", "sgd"])
    config = planning_config(args)
    assert config == autopar.PlanConfig(force=autopar.Layout(dp=2, tp=2, zero=2), pipeline=autopar.Pipeline(
        stages=2, schedule="1f1b"), idle_axes=(), memory_budget="40GB", bucket_bytes=4 << 20, optimizer="sgd")
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["plan"]._actions}
    assert len(USER_OPTIONS) == 11 and {"layout", "bucket_size", "time_limit", "precision"} <= flags  # every user option has a flag
    # a keyword is the same option as the config's field, applied over a given config
    assert autopar.PlanConfig.of(config, pipeline=False).pipeline is None
    assert autopar.PlanConfig.of(config, solver="cbc").replace(idle_axes=[0]) == dataclasses.replace(
        config, solver="cbc", idle_axes=(0,))
    with pytest.raises(autopar.ConfigError, match="unknown planning option.*memory_bugdet.*memory_budget"):
        autopar.PlanConfig.of(memory_bugdet="40GB")
    with pytest.raises(autopar.ConfigError, match="unknown planning option.*pipline"):
        autopar.plan(None, autopar.Mesh((2,)), (), pipline=False)
    for bad, match in ((dict(optimizer="lion"), "unknown optimizer 'lion'"), (dict(pipeline="yes"), "pipeline='yes'"),
                       (dict(solver="gurobi"), "unknown ILP solver"), (dict(bucket_bytes=0), "bucket_bytes=0"),
                       (dict(idle_axes=1), "idle_axes=1"), (dict(force="tp"), "force='tp'"),
                       (dict(microbatches=0), "microbatches=0"), (dict(time_limit_s=0), "time_limit_s=0")):
        with pytest.raises(autopar.ConfigError, match=match):
            autopar.PlanConfig(**bad)
    with pytest.raises(autopar.ConfigError, match="config must be an autopar.PlanConfig"):
        autopar.plan(None, autopar.Mesh((2,)), (), config={"pipeline": False})


def test_an_unknown_attribute_raises_a_helpful_attribute_error():
    out = run_fresh("""
        import autopar
        try:
            autopar.modles
        except AttributeError as e:
            print(e)
        print(hasattr(autopar, "nope"), getattr(autopar, "nope", 42))
    """)
    message, probe = out.strip().splitlines()
    assert "'autopar' has no attribute 'modles'" in message
    assert "models" in message and "plan" in message  # lists what does exist
    assert probe == "False 42"
