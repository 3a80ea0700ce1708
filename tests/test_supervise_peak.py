"""flywheel.supervise.run_measuring_peak: the kernel's peak RSS of one child, as the demo
records each learner cycle's."""

import json
import subprocess
import sys

import pytest

from flywheel.supervise import run_measuring_peak

# Measured from a small parent process: the kernel starts a child's peak count at its parent's
# RSS at fork, and this test's own process (pytest after a thousand tests) can be gigabytes.
_MEASURE = """
import json, sys
from flywheel.supervise import run_measuring_peak

def child(mb):
    return [sys.executable, "-c",
            f"b = bytearray({mb} * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\ndel b\\n"
            "import sys; sys.exit(3)"]

print(json.dumps([run_measuring_peak(child(mb)) for mb in (50, 350)]))
"""


def test_peak_counts_a_freed_buffer_and_the_exit_code_is_kept():
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True)
    (code_small, small), (code_big, big) = json.loads(out.stdout)
    assert (code_small, code_big) == (3, 3)
    # the 350 MB child peaks 300 MB above the 50 MB one (same interpreter, same imports)
    assert abs((big - small) - 300 * 2**20) <= 16 * 2**20


def test_a_missing_program_raises():
    with pytest.raises(OSError):
        run_measuring_peak(["/nonexistent/flywheel-no-such-program"])
