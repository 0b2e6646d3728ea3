"""examples/python/tp_linear.py runs as its docstring says, under torchrun with 2 ranks on the
CPU, and its row-parallel layer agrees with the unsplit layer and with
torch.distributed.all_reduce. Skipped, with the reason, without torch."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed: the example is not run")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "tp_linear.py"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_linear_under_torchrun_on_two_cpu_ranks(dtype):
    # torch.distributed.run is torchrun's module; --standalone picks a free port.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(EXAMPLE), "--dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = re.findall(r"^rank (\d)/2 cpu .*$", done.stdout, re.M)
    assert sorted(lines) == ["0", "1"], out
    for line in re.findall(r"^rank \d/2 cpu .*$", done.stdout, re.M):
        assert line.endswith("; ok"), line
        # Two ranks: one addition, the same in either order (for bfloat16, both round that
        # float32 sum once), so the bits agree.
        assert "bitwise equal to torch.distributed: True" in line, line
