"""flywheel.supervise.run_measuring_peak: the kernel's peak RSS of one child, as the demo
records each learner cycle's."""

import sys

from flywheel.supervise import run_measuring_peak


def _child(mb: int) -> list[str]:
    # touch every page of an ``mb`` MB buffer, then free it before exiting: the peak stays
    return [sys.executable, "-c",
            f"b = bytearray({mb} * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\ndel b\n"
            "import sys; sys.exit(3)"]


def test_peak_counts_a_freed_buffer_and_the_exit_code_is_kept():
    # Both children peak well above the floor the kernel starts a child's count at (the parent's
    # RSS at fork), so their difference is the 300 MB one buffer has over the other.
    code_small, small = run_measuring_peak(_child(300))
    code_big, big = run_measuring_peak(_child(600))
    assert (code_small, code_big) == (3, 3)
    assert abs((big - small) - 300 * 2**20) <= 16 * 2**20


def test_a_missing_program_raises():
    import pytest

    with pytest.raises(OSError):
        run_measuring_peak(["/nonexistent/flywheel-no-such-program"])
