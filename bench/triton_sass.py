"""What the decode GEMVs compile to on Hopper, without a GPU: instructions per code in the main loop.

    python bench/triton_sass.py            # table on stdout; --out F writes JSON

Each kernel is compiled ahead of time for sm_90 (Triton's own ptxas; no device needed) at W4
g128 symmetric, one activation row, and disassembled with the cuobjdump Triton ships. The main
loop is the span of the backward branch; its instruction count over the codes each thread
decodes per iteration gives instructions per code, and barriers (``BAR``) in it are
shared-memory round trips that stall the whole program. Registers come from ``-res-usage``.
A static profile: it says where a kernel spends issue slots, not how fast it runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ARGS = ["x_ptr", "w_ptr", "s_ptr", "z_ptr", "perm_ptr", "bias_ptr", "y_ptr", "part_ptr", "count_ptr"]
ARGS += ["M", "N", "K", "KW", "G", "stride_xm", "stride_ym"]
TYPES = ["*bf16", "*i32", "*fp16", "*u8", "*i32", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 7
ALIGNED = ["x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "count_ptr", "K", "KW", "N", "stride_xm", "stride_ym"]
# (kernel, BN, NB, SPLIT_K, warps[, bits, zero]): zero -1 is a per-row, per-block zero point (asymmetric)
CASES = [
    ("_gemv_kernel", 16, 2, 4, 4),
    ("_gemv_kernel", 32, 2, 4, 4),
    ("_gemv_row_kernel", 32, 1, 4, 1),
    ("_gemv_row_kernel", 64, 2, 4, 2),
    ("_gemv_row_kernel", 128, 1, 4, 2),
    ("_gemv_row_kernel", 256, 1, 4, 4),
    ("_gemv_row_kernel", 128, 1, 4, 2, 4, -1),
    ("_gemv_row_kernel", 128, 1, 4, 2, 8, 128),
]


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_profile(kernel: str, bn: int, nb: int, split: int, warps: int, bits: int = 4, zero: int = 8) -> dict:
    """Compile ``kernel`` for sm_90 and profile its main loop (see the module docstring)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmpress.runtime.kernels import triton_gemv

    constants = dict(BITS=bits, C=128, ZERO=zero, HAS_PERM=False, HAS_BIAS=False, BM=1)
    constants |= dict(BN=bn, NB=nb, SPLIT_K=split)
    signature = dict(zip(ARGS, TYPES, strict=True)) | {name: "constexpr" for name in constants}
    index = {name: i for i, name in enumerate(signature)}
    source = ASTSource(
        fn=getattr(triton_gemv, kernel),
        signature=signature,
        constexprs={(index[name],): value for name, value in constants.items()},
        attrs={(index[name],): [["tt.divisibility", 16]] for name in ALIGNED},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin.name], capture_output=True, text=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    code = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(?:\S*)\s*(0x[0-9a-f]+)?")
    instructions = [(int(m[1], 16), m[2], m[3]) for m in map(code.match, sass.splitlines()) if m]
    branches = [(int(target, 16), at) for at, op, target in instructions if op == "BRA" and target]
    loops = [(target, at) for target, at in branches if target < at]
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = collections.Counter(op for at, op, _ in instructions if start <= at <= end)
    codes_per_thread = bn * (128 * bits // 32) * nb * (32 // bits) / (32 * warps)
    registers = int(re.search(r"REG:(\d+)", usage)[1])
    spilled = int(re.search(r"LOCAL:(\d+)", usage)[1])
    return {
        "kernel": kernel, "bits": bits, "zero": zero, "BN": bn, "NB": nb, "SPLIT_K": split, "warps": warps,
        "registers": registers, "local_bytes": spilled,
        "loop_instructions": sum(body.values()), "codes_per_thread": codes_per_thread,
        "instructions_per_code": round(sum(body.values()) / codes_per_thread, 2), "barriers": body["BAR"],
        "top": body.most_common(8),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [loop_profile(*case) for case in CASES]
    print("| kernel | bits | zero | BN | NB | warps | registers | loop instructions per code", end="")
    print(" | barriers per iteration |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['bits']} | {r['zero']} | {r['BN']} | {r['NB']} | {r['warps']} | {r['registers']} | "
            f"{r['instructions_per_code']} | {r['barriers']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
