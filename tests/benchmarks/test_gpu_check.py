"""``make gpu-check`` (benchmarks/gpu_check.py) is ready to run when a GPU is lent: its CPU dry run
goes through every part and writes its figures, and with a world of one the bf16 module trains
exactly as the one-process recipe (the plan replicates everything: the same ops in the same order);
ring attention's blocks through the CPU's fused kernel agree with the math path to bf16's rounding."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["cluster"] == "cpu-gloo" and got["bf16"]["param_dtypes"] == ["torch.float32"]
    assert got["bf16"]["to_recipe"] == 0.0 and got["bf16"]["recipe_noise"] > 0
    assert [r["op"].split()[0] for r in got["ops"]] == ["mm", "sdpa", "mm", "mm", "gelu", "mm", "layer_norm"]
    assert all(r["forward_measured_s"] > 0 and r["fwd_bwd_predicted_s"] > r["forward_predicted_s"] for r in got["ops"])
    assert len(got["ring_blocks"]) == 4 and all(r["kernel"] == "cpu" for r in got["ring_blocks"])
    assert all(0 < r["max_rel_diff"] < 0.05 for r in got["ring_blocks"]), got["ring_blocks"]
