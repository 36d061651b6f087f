"""`make bench`: every benchmark, one after the other. Figures only; nothing here asserts."""
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHES = ["plan_time.py", "gpt3_pipeline.py", "whatif_grid.py", "hybrid.py", "zoo.py", "fidelity.py",
           "memory_fidelity.py", "long_context.py"]

for name in BENCHES:
    print(f"== {name}", flush=True)
    subprocess.run([sys.executable, str(HERE / name)], check=True)
