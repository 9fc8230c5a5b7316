"""``lmpress --version``: what a user pastes into a bug report."""

import subprocess
import sys

import torch

import lmpress


def test_version_names_lmpress_torch_and_python():
    done = subprocess.run([sys.executable, "-m", "lmpress", "--version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"lmpress {lmpress.__version__} (torch {torch.__version__},"), line
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in line
