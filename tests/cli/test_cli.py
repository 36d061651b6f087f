"""The `autopar` command line: explain prints a plan, bad arguments give one line and exit code 2."""
import json
import sys
import warnings
from pathlib import Path

import pytest

import autopar
from autopar.cli.main import main

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_builtin_model_and_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "explain", "mlp:layers=1", "--mesh", "2x2", "--cluster", "a100-80g", "--json", str(path))
    assert code == 0, err
    assert "plan for MLP on mesh 2x2" in out and "predicted step time" in out and "layers.0" in out
    plan = autopar.Plan.load(path)
    assert plan.mesh["shape"] == [2, 2] and plan.mesh["cluster"]["name"] == "a100-80g"
    assert json.loads(path.read_text())["schema_version"] == 6


def test_explain_user_factory(capsys):
    code, out, err = run(capsys, "explain", "factory_model:build", "--mesh", "4")
    assert code == 0, err
    assert "plan for Sequential on mesh 4" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "mlp", "--mesh", "2xq"], "mesh must look like"),
        (["explain", "mlp", "--mesh", "0x2"], "mesh sizes must be positive"),
        (["explain", "nosuchmodel", "--mesh", "2"], "unknown model"),
        (["explain", "mlp:width=", "--mesh", "2"], "width"),
        (["explain", "factory_model:missing", "--mesh", "2"], "cannot load model factory"),
        (["explain", "factory_model:broken", "--mesh", "2"], "must return (model, example_inputs)"),
        (["explain", "mlp", "--mesh", "2", "--cluster", "tpu-v9"], "unknown cluster"),
        (["explain", "mlp", "--mesh", "2", "--memory-budget", "lots"], "cannot read memory size"),
        (["explain", "mlp", "--mesh", "2", "--memory-budget", "1KB"], "smallest plan needs"),
        (["explain", "mlp", "--mesh", "3x5", "--profiled"], "no cached profile"),
        (["explain", "mlp", "--mesh", "2", "--json", "/nonexistent/dir/plan.json"], "cannot write the plan"),
        (["explain", "mlp"], "--mesh"),
        (["frobnicate"], "invalid choice"),
        (["profile"], "give --mesh"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("autopar: error:") and message in lines[0], lines[0]


def test_explain_code_prints_the_rank_program(capsys):
    code, out, err = run(capsys, "explain", "mlp:layers=1", "--mesh", "2", "--code")
    assert code == 0, err
    program = out.split("# the program every rank runs")[1]
    assert "def forward(" in program and "torch.ops.aten.linear.default" in program
    assert "autopar_backward_seed" in program


def test_explain_code_prints_each_stage_program(capsys):
    """A plan with stages (2 of them, within 600 MiB per device): --code prints the program of every
    stage, each reading what the stage before it sends."""
    model = "gpt:layers=8,width=1024,heads=16,seq=256,vocab=8192,batch=16"
    code, out, err = run(capsys, "explain", model, "--mesh", "4", "--cluster", "a100-80g", "--memory-budget", "600MiB",
                         "--pipeline", "stages=2,schedule=1f1b", "--code")
    assert code == 0, err
    stages = out.split("# stage ")[1:]
    assert len(stages) >= 2 and all("def forward(" in s for s in stages)
    assert "embedding" in stages[0] and "embedding" not in stages[-1]  # the first stage embeds, the last does not


def test_explain_a_published_shape_by_name(capsys):
    """A published shape by name (two of its layers, to stay quick), on an A100 mesh."""
    code, out, _ = run(capsys, "explain", "gpt2-xl:layers=2,batch=16", "--mesh", "2x4", "--cluster", "a100-80g")
    assert code == 0
    assert "plan for GPT on mesh 2x4" in out and "predicted step time" in out
    assert "autopar dry-run" not in out  # 8 ranks run here
    code, out, _ = run(capsys, "explain", "gpt2-xl:layers=2,batch=16", "--mesh", "4x4", "--cluster", "a100-80g",
                       "--pipeline", "off")
    assert code == 0 and "before launching 16 ranks: `autopar dry-run`" in out


def test_explain_a_transformers_config_file(capsys, tmp_path):
    """hf:config.json builds the model without weights (meta device) and plans it."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64).to_json_file(path)
    code, out, _ = run(capsys, "explain", f"hf:{path}:batch=4,seq=32", "--mesh", "2", "--cluster", "a100-80g")
    assert code == 0, out
    assert "plan for GPT2LMHeadModel on mesh 2" in out
    code, out, err = run(capsys, "explain", f"hf:{tmp_path}/missing.json", "--mesh", "2")
    assert code == 2 and "no such config file" in (out + err)


def test_plan_files_explain_and_diff(capsys, tmp_path):
    """`autopar plan -o`, `autopar explain plan.json`, `autopar diff`: a plan against itself has no
    differences; a memory-bound plan against the free one lists the storage it changed and what
    that costs."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    model = "gpt:layers=2,width=128"
    one = ("--pipeline", "off")  # the diff compares one-stage plans' storage
    code, out, _ = run(capsys, "plan", model, "--mesh", "2x2", "--cluster", "a100-80g", *one, "-o", str(a))
    assert code == 0 and a.exists() and "1 stage(s)" in out
    code, out, _ = run(capsys, "plan", model, "--mesh", "2x2", "--cluster", "a100-80g", "--memory-budget", "4MiB", *one,
                       "-o", str(b))
    assert code == 0
    code, out, _ = run(capsys, "explain", str(a))
    assert code == 0 and "plan for GPT on mesh 2x2" in out
    code, out, _ = run(capsys, "diff", str(a), str(a))
    assert code == 0 and out.strip() == "no differences"
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 0 and "stored replicated" in out and "predicted step time" in out and "MiB ->" in out
    code, out, err = run(capsys, "plan", model, "-o", str(a))
    assert code == 2 and "--mesh is required" in err


def test_progress_shows_only_on_a_terminal_and_not_when_quiet():
    """The library logs its steps (logging, never print); the CLI shows them on a terminal unless
    --quiet, and stays silent when stderr is a file or pipe."""
    import io
    import logging

    from autopar.cli.main import progress_handler

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_handler(io.StringIO(), quiet=False) is None
    assert progress_handler(Tty(), quiet=True) is None
    stream = Tty()
    handler = progress_handler(stream, quiet=False)
    logger = logging.getLogger("autopar")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        model, inputs = autopar.models.build("gpt", layers=1)
        autopar.plan(model, autopar.Mesh((2,)), inputs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    text = stream.getvalue()
    assert "autopar: traced GPT" in text and "autopar: planned GPT" in text


def test_explain_with_what_ifs(capsys):
    code, out, _ = run(capsys, "explain", "gpt:layers=2", "--mesh", "2x2", "--cluster", "a100-80g",
                       "--compare", "dp=2,tp=2", "dp=4,zero=3")
    assert code == 0
    assert "what-ifs, priced by the same cost model:" in out
    assert "dp=2,tp=2" in out and "dp=4,zero=3" in out and out.count(" ms ") >= 3


@pytest.mark.parametrize("argv, message", [
    (["explain", "hf:cfg.json:layers=2", "--mesh", "2"], "options are batch, seq and dtype"),
    (["explain", "gpt:dtype=float99", "--mesh", "2"], "not a torch dtype"),
    (["explain", "gpt:layers=1", "--mesh", "2", "--compare", "dp=2", "tp=2,recompute=some"], "recompute must be none, full or selective"),
    (["explain", "gpt:layers=1", "--mesh", "2", "--compare", "dp=4"], "the mesh has 2 devices"),
])
def test_cli_model_and_what_if_errors_are_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text("{}")
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert "plan for" not in out  # what-ifs are checked before anything is planned


def test_explain_with_a_dtype_option(capsys):
    code, out, _ = run(capsys, "explain", "gpt:layers=1,dtype=bfloat16", "--mesh", "2", "--cluster", "a100-80g")
    assert code == 0 and "plan for GPT" in out


def test_demo_runs_to_a_successful_exit(capsys, monkeypatch, tmp_path):
    # `make demo` in short: 4 gloo ranks; autopar's pick with the hand layouts priced beside it, then
    # a 2x2 data x tensor parallel plan and a 2-stage pipeline, each exact in the plain loop
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))  # the spawned ranks inherit it
    code, out, err = run(capsys, "demo", "--steps", "3")
    assert code == 0, out[-2000:] + err[-2000:]
    assert "every layout's losses match the single-process model" in out
    assert "layout: data parallel 2 x tensor parallel 2" in out
    assert "layout: pipeline parallel 2 x data parallel 2" in out
    assert "hand-written layouts on the same mesh, priced by the same cost model" in out and "dp=2,tp=2" in out
    assert out.count("measured (slowest rank's median)") == 3 and out.count("ms predicted") == 3


def test_the_demo_holds_losses_to_one_process_or_to_its_own_rounding():
    """A loss matches within 1e-5 of the single-process one, or within 10x that one's own distance
    from float64; beyond both, or different across ranks, it does not."""
    from autopar.cli.demo import compare_losses

    ref, exact = [2.0, 2.0], [2.0, 2.0 + 2e-5]  # the second step: one process 1e-5 from float64
    assert compare_losses([{"losses": [2.0, 2.0 + 1.8e-5]}], [2.0, 2.0], [2.0, 2.0]) == (True, pytest.approx(9e-6))
    assert compare_losses([{"losses": [2.0, 2.0 + 8e-5]}], ref, exact)[0]  # 4e-5 < 10 x 1e-5
    assert not compare_losses([{"losses": [2.0, 2.0 + 4e-4]}], ref, exact)[0]  # 2e-4 > both
    assert not compare_losses([{"losses": [2.0, 2.0 + 8e-5]}], ref, [2.0, 2.0])[0]  # no rounding to hide in
    assert not compare_losses([{"losses": [2.0, 2.0]}, {"losses": [2.0, 2.0 + 1e-7]}], ref, exact)[0]


def test_profile_then_explain_profiled_a_cluster_file_and_a_kwargs_factory(capsys, monkeypatch, tmp_path):
    """The happy paths: `profile --mesh` (local gloo ranks) and `profile --ops` write the cache that
    `explain --profiled` prices with; `--cluster FILE` reads a ClusterSpec; a factory may return
    keyword inputs."""
    from autopar.cluster import PRESETS

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "profile", "--mesh", "2")
    assert code == 0, err
    assert "alpha (us)" in out and "per-collective factors" in out and (tmp_path / "cache" / "comm-gloo-2.json").exists()
    code, out, err = run(capsys, "profile", "--ops", "mlp")
    assert code == 0, err
    assert "timed" in out and list((tmp_path / "cache").glob("ops-*.json"))
    code, profiled, err = run(capsys, "explain", "mlp", "--mesh", "2", "--profiled")
    assert code == 0, err
    assert "cluster cpu-gloo+profiled" in profiled
    spec = PRESETS["cpu-gloo"].to_dict() | {"name": "my-cluster", "op_overhead_s": 1e-3}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    code, out, err = run(capsys, "explain", "mlp", "--mesh", "2", "--cluster", str(path))
    assert code == 0, err
    assert "cluster my-cluster" in out
    code, out, err = run(capsys, "explain", "factory_model:build_with_kwargs", "--mesh", "2", "--cluster", "a100-80g")
    assert code == 0, err
    assert "plan for _Keyed on mesh 2" in out


def test_dry_run_a_plan_and_a_plan_file(capsys, tmp_path):
    """`autopar dry-run`: every rank of a 2x2 plan run on meta tensors, its table and OK; a plan file
    read back; ranks outside the mesh refused in one line."""
    model, flags = "gpt:layers=2,width=128", ("--mesh", "2x2", "--cluster", "a100-80g", "--layout", "dp=2,tp=2",
                                              "--pipeline", "off")
    record = tmp_path / "dry.json"
    code, out, err = run(capsys, "dry-run", model, *flags, "--ranks", "all", "--json", str(record))
    assert code == 0, out + err
    assert "dry run of 4 of 4 ranks" in out and "every collective matched" in out and out.splitlines()[-1] == "OK"
    assert "all_reduce" in out and "ranks [0, 1]" in out
    saved = json.loads(record.read_text())
    assert saved["ok"] and [r["rank"] for r in saved["ranks"]] == [0, 1, 2, 3]
    assert all(r["step_collectives"] > 0 and abs(r["peak_bytes"] / r["predicted_bytes"] - 1) <= 0.1 for r in saved["ranks"])
    plan = tmp_path / "plan.json"
    assert run(capsys, "plan", model, *flags, "-o", str(plan))[0] == 0
    code, out, err = run(capsys, "dry-run", model, "--plan", str(plan), "--quiet")
    assert code == 0 and "dry run of 4 of 4 ranks" in out  # the sample of a 2x2 mesh: its corners, every rank
    code, out, err = run(capsys, "dry-run", model, "--plan", str(plan), "--ranks", "0,9")
    assert code == 2 and "ranks [9] are not ranks of the plan's mesh of 4" in err
