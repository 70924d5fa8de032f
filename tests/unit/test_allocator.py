"""The monitor's fixed mmap threshold (streamrft/runtime/allocator.py): glibc takes it; run in a child process,
since it changes how the whole process allocates."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's mmap threshold is glibc's")
def test_glibc_takes_the_fixed_mmap_threshold():
    code = "from streamrft.runtime.allocator import fix_mmap_threshold\nprint(fix_mmap_threshold())\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
