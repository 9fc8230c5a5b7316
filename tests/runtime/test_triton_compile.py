"""lmpress's newer Triton kernels compile ahead of time for Hopper (sm_90, the H100/H200 a GPU visit meets) and
Ampere (sm_80) down to a cubin, with Triton's own ptxas and no GPU: what the interpreter cannot check (types,
returns, dot shapes and layouts the real compiler refuses) fails here, not on a lent machine.

The compile runs in a fresh process without ``TRITON_INTERPRET`` (test modules set it before importing triton,
which makes ``triton.jit`` return interpreted functions).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (lmpress[dev])")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]

COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmpress.runtime.kernels import triton_attention as ta, triton_fwht as tf

def build(fn, signature, constexprs):
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm.get("cubin"), fn
    print("compiled", fn.__name__, constexprs)

shape = {"KV_HEADS": 8, "GROUP": 4, "N": 1, "D": 128, "R": 16, "CHUNK": ta.CHUNK}
# float entries, int8, FP8 per head and per tensor, INT4 per slot, KIVI's INT4 keys (by groups, with the ring)
for q, codes, k_mode, v_mode, scales in [("*bf16", "*bf16", 0, 0, "*fp32"), ("*bf16", "*i8", 1, 1, "*fp32"),
                                         ("*fp16", "*u8", 2, 2, "*fp32"), ("*bf16", "*u8", 3, 3, "*fp32"),
                                         ("*fp16", "*u8", 4, 4, "*fp16"), ("*bf16", "*u8", 5, 4, "*fp16")]:
    split = {"q_ptr": q, "k_ptr": codes, "v_ptr": codes, "ks_ptr": scales, "vs_ptr": scales, "ring_ptr": "*fp32",
             "mask_ptr": "*u8", "pos_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
             "n_slots": "i32", "key_slots": "i32", "splits": "i32", "sm_scale": "fp32"}
    build(ta._split_kernel, split, {**shape, "K_MODE": k_mode, "V_MODE": v_mode, "FP8": k_mode in (2, 3),
                                    "DOT_F32": False, "BLOCK_S": ta.BLOCK_S, "KEY_GROUP": 32, "RING": 64})
merge = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*bf16", "splits": "i32"}
build(ta._merge_kernel, merge, shape)
small = {"x_ptr": "*bf16", "h_ptr": "*fp32", "y_ptr": "*bf16", "n_blocks": "i32", "scale": "fp32"}
for block in (16, 128):
    build(tf._small_kernel, small, {"B": block, "ROWS": tf.TILE_ROWS})
kron = {"x_ptr": "*bf16", "h1_ptr": "*fp32", "h2_ptr": "*fp32", "y_ptr": "*bf16", "scale": "fp32"}
for block in (256, 512, 4096):
    b1, b2 = tf.factors(block)
    build(tf._kronecker_kernel, kron, {"B1": b1, "B2": b2})
"""


@pytest.mark.long
@pytest.mark.skipif(not PTXAS.is_file(), reason="this triton has no NVIDIA backend with ptxas")
@pytest.mark.parametrize("capability", [90, 80])  # Hopper; Ampere (A100), which has no FP8 types
def test_decode_attention_and_hadamard_kernels_compile(capability):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    source = COMPILE.replace('GPUTarget("cuda", 90, 32)', f'GPUTarget("cuda", {capability}, 32)')
    run = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 12
