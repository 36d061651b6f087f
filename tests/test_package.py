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


def test_plan_and_parallelize_show_their_options_and_share_them():
    """``help()`` and editors see real signatures; the planning options are the same keywords with
    the same defaults in ``plan``, ``parallelize`` and the CLI's flags."""
    import inspect

    import autopar
    from autopar.cli.main import build_parser, planning_options
    from autopar.solver.api import PLANNING_OPTIONS

    plan_sig, par_sig = inspect.signature(autopar.plan), inspect.signature(autopar.parallelize)
    for name in PLANNING_OPTIONS:
        assert plan_sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert par_sig.parameters[name].default == plan_sig.parameters[name].default, name
    assert "memory_budget" in autopar.parallelize.__doc__ and "pipeline" in autopar.plan.__doc__
    args = build_parser().parse_args(["plan", "gpt", "--mesh", "4", "-o", "p.json"])
    options = planning_options(args)
    assert set(options) == set(PLANNING_OPTIONS)
    for name in PLANNING_OPTIONS:  # the CLI's defaults are the functions' defaults
        assert options[name] == plan_sig.parameters[name].default, name
    args = build_parser().parse_args(["plan", "gpt", "--mesh", "2x2", "-o", "p.json", "--layout", "dp=2,tp=2,zero=2",
                                      "--pipeline", "stages=2,schedule=1f1b", "--idle-axes", "none",
                                      "--memory-budget", "40GB", "--bucket-size", "4MiB"])
    options = planning_options(args)
    assert options["force"] == autopar.Layout(dp=2, tp=2, zero=2)
    assert options["pipeline"] == autopar.Pipeline(stages=2, schedule="1f1b")
    assert options["idle_axes"] == () and options["memory_budget"] == "40GB" and options["bucket_bytes"] == 4 << 20


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
