"""scripts/gpu_check.sh on a machine without a GPU: its CPU parts run and write their report."""

import os
import subprocess
import sys
from pathlib import Path

import tensorflow as tf

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_parts(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_SKIP_SETUP="1", KB_PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               GPU_CHECK_TESTS="tests/test_setup_plan.py -k cpu_machine", GPU_CHECK_BUDGET_S="400")
    if not tf.config.list_physical_devices("GPU"):  # a PATH without nvidia-smi
        env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True,
                            text=True, env=env, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "- keras-boost info: ok" in summary and "- GPU tests: ok" in summary
    assert "- benchmark, 1 process: ok" in summary
    assert f"TensorFlow        {tf.__version__}" in (out / "info.txt").read_text()  # the TensorFlow this suite runs on
    table = (out / "bench.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| 1 |")]
    # keras and O1, float32 and mixed precision (mixed_bfloat16 on a CPU), each measured
    assert [row.split(" | ")[1:3] for row in rows] == [["keras", "float32"], ["O1", "float32"],
                                                        ["keras", "mixed_bfloat16"], ["O1", "mixed_bfloat16"]]
    assert all(float(row.split(" | ")[3]) > 0 for row in rows)
    assert "## Benchmark" in summary and rows[0] in summary
