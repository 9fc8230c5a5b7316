"""``lmpress --version``: what a user pastes into a bug report."""

import os
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


def test_commands_quiet_transformers_without_importing_it():
    """Importing transformers takes a second here: a command that never needs it (``generate`` on an export)
    must not pay it to quiet its bars; where it is imported already (lmpress called from Python), it is quieted."""
    script = (
        "import os, sys\n"
        "from lmpress import cli\n"
        "cli.quiet_transformers()\n"
        "print('transformers' in sys.modules, os.environ['TRANSFORMERS_VERBOSITY'])\n"
        "import transformers\n"
        "from transformers.utils import logging\n"
        "print(logging.get_verbosity() == logging.ERROR, logging.is_progress_bar_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.split() == ["False", "error", "True", "False"], done.stdout
