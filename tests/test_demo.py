"""`make demo` (examples/guide.py) runs and shows the guide's run, resumed bit for bit."""

import os
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "examples" / "guide.py"


def test_guide_example_resumes_exactly(tmp_path):
    env = {**os.environ, "JAXCKPT_DEMO_DIR": str(tmp_path / "demo_ckpts")}
    proc = subprocess.run([sys.executable, str(GUIDE)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Initializing from scratch." in out
    assert "Restored from " in out and "ckpt-5 (step 50)" in out
    assert out.count("Saved checkpoint for step") == 10
    assert "ckpt-8', '" in out and out.rstrip().endswith("bit for bit: True")
    assert "optimizer/opt_state/0/mu/l1/kernel       (1, 5)" in out
