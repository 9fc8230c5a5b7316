"""One of lmpress's CPU kernel sources at another git revision, built and loaded beside today's library under an op
namespace of its own: the benches' ``--against REV`` (two versions of a kernel timed interleaved in one process)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_at_rev(rev: str, source: str, namespace: str) -> None:
    """``lmpress/runtime/kernels/<source>`` at ``rev``, with the headers it includes from there, its ops registered
    as ``torch.ops.<namespace>`` instead of ``torch.ops.lmpress_cpu``; built once into lmpress's cache."""
    from lmpress.runtime.kernels.cpp_build import build_directory, build_library
    from lmpress.runtime.kernels.cpu_int import CFLAGS, LDFLAGS

    def at_rev(name: str) -> str:
        path = f"{rev}:lmpress/runtime/kernels/{name}"
        return subprocess.run(["git", "show", path], cwd=REPO, check=True, capture_output=True).stdout.decode()

    text = re.sub(r"\b(TORCH_LIBRARY\w*)\(lmpress_cpu,", rf"\1({namespace},", at_rev(source))
    headers = {name: at_rev(name) for name in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)}
    name, build = build_directory(namespace, (text + "".join(headers.values())).encode(), [*CFLAGS, *LDFLAGS])
    for header, body in headers.items():  # the revision's own headers, beside the source that includes them
        (build / header).write_text(body)
    path = build / f"{Path(source).stem}_{namespace}.cpp"
    path.write_text(text)
    build_library(name, [path], build, CFLAGS, f"{source} as of {rev}", extra_ldflags=LDFLAGS)
