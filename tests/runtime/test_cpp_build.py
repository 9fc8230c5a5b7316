"""Kernel builds into the cache survive a builder killed mid-build and wait for a live one."""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.utils.cpp_extension
from torch.utils.file_baton import FileBaton

from lmpress.runtime.kernels import cpp_build

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

# A builder that takes lmpress's lock and torch's lock file, says so, then holds both for `hold` seconds.
BUILDER = """
import sys, time
from pathlib import Path
from torch.utils.file_baton import FileBaton
from lmpress.runtime.kernels.cpp_build import TORCH_BATON, sole_builder
build, hold = Path(sys.argv[1]), float(sys.argv[2])
with sole_builder(build):
    baton = FileBaton(str(build / TORCH_BATON))
    assert baton.try_acquire()
    print("held", flush=True)
    time.sleep(hold)
    (build / "done").touch()
    baton.release()
"""


def start_builder(build: Path, hold: float) -> subprocess.Popen:
    builder = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(build), str(hold)], stdout=subprocess.PIPE, text=True
    )
    assert builder.stdout.readline().strip() == "held"
    return builder


def test_torch_takes_the_lock_file_this_module_clears() -> None:
    source = inspect.getsource(torch.utils.cpp_extension._jit_compile)
    assert f"FileBaton(os.path.join(build_directory, '{cpp_build.TORCH_BATON}'))" in source


def test_a_build_killed_mid_way_does_not_hang_the_next(tmp_path: Path, monkeypatch, capfd) -> None:
    builder = start_builder(tmp_path, hold=600)
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    assert (tmp_path / cpp_build.TORCH_BATON).exists()  # what torch alone would wait on forever

    acquired = []

    def fake_load(name, sources, build_directory, **_) -> None:  # noqa: ANN001 - cpp_extension.load's call
        baton = FileBaton(os.path.join(build_directory, cpp_build.TORCH_BATON))
        acquired.append(baton.try_acquire())
        baton.release()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    start = time.perf_counter()
    cpp_build.build_library("lib", [tmp_path / "a.cpp"], tmp_path, ["-O3"], "a test library")
    assert acquired == [True] and time.perf_counter() - start < 10
    assert f"removing {tmp_path / cpp_build.TORCH_BATON}" in capfd.readouterr().err


def test_a_live_builder_is_waited_for_and_its_lock_file_left_alone(tmp_path: Path, capfd) -> None:
    builder = start_builder(tmp_path, hold=1.5)
    with cpp_build.sole_builder(tmp_path):
        assert (tmp_path / "done").exists()  # entered only once the live builder had finished
    builder.wait()
    assert builder.returncode == 0
    assert "removing" not in capfd.readouterr().err


def test_the_build_directory_is_named_by_its_sources_and_flags(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path))
    name, build = cpp_build.build_directory("lib", b"int f();", ["-O3"])
    assert build.is_dir() and build == tmp_path / "kernels" / name and name.startswith("lib_")
    assert cpp_build.build_directory("lib", b"int f();", ["-O3"])[0] == name
    assert cpp_build.build_directory("lib", b"int g();", ["-O3"])[0] != name
    assert cpp_build.build_directory("lib", b"int f();", ["-O2"])[0] != name  # ninja would compile it again
    assert cpp_build.build_directory("lib", b"int f();", ["-O3", "-g"])[0] != name


def test_a_filesystem_without_locks_builds_under_torch_s_lock_alone(tmp_path: Path, monkeypatch) -> None:
    import fcntl

    def refuse(*_) -> None:  # noqa: ANN002 - fcntl.flock's arguments
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    (tmp_path / cpp_build.TORCH_BATON).touch()  # without our lock it cannot be known stale: it is left to torch
    with cpp_build.sole_builder(tmp_path):
        assert (tmp_path / cpp_build.TORCH_BATON).exists()


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja")
def test_a_build_whose_inputs_changed_is_stale(tmp_path: Path) -> None:
    """ninja's own verdict: built and untouched, nothing to do; a file it was built from newer than the result (a
    reinstalled torch's headers), a build to come."""
    (tmp_path / "header.h").write_text("int f();")
    (tmp_path / "build.ninja").write_text("rule copy\n  command = cp $in $out\nbuild lib.so: copy header.h\n")
    subprocess.run(["ninja", "-C", str(tmp_path)], check=True, capture_output=True)
    assert not cpp_build.build_is_stale(tmp_path)
    later = (tmp_path / "lib.so").stat().st_mtime + 10
    os.utime(tmp_path / "header.h", (later, later))
    assert cpp_build.build_is_stale(tmp_path)


@pytest.mark.parametrize(
    ("built", "stale", "said"), [(False, False, "once"), (True, True, "again"), (True, False, None)]
)
def test_a_start_that_compiles_says_so(tmp_path: Path, monkeypatch, capfd, built, stale, said) -> None:
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *_, **__: None)
    monkeypatch.setattr(cpp_build, "build_is_stale", lambda build: stale)
    if built:
        (tmp_path / "lib.so").touch()
    cpp_build.build_library("lib", [tmp_path / "a.cpp"], tmp_path, ["-O3"], "the test kernels")
    err = capfd.readouterr().err
    if said is None:
        assert "compiling" not in err
    else:
        assert f"compiling the test kernels {said}" in err and str(tmp_path) in err
