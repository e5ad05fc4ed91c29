"""Only the C extension: every other piece of metadata lives in pyproject.toml.

The CPU quantized kernels (workers/kernels/cpu_quant/*.c) are a plain C
library loaded with ctypes, built as an optional extension: without a C
compiler the install still succeeds and the library reports itself
unavailable (docs/cpu_kernels.md).
"""
import glob
import os
import sys

from setuptools import Extension, setup

_SRC = "workers/kernels/cpu_quant"


def _flags() -> tuple[list[str], list[str]]:
    if sys.platform == "win32":  # MSVC: no OpenMP 4 reductions on int64 loops; built single-threaded
        return ["/O2"], []
    # No -march: one binary for every x86-64 (the variants pick their ISA at run time).
    # -ffp-contract=off: dequantization must round like numpy (no fused multiply-adds).
    # -fno-trapping-math: lets the float loops of ops.c (clamps) vectorize; rounding unchanged.
    compile_args = ["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
                    "-fno-strict-aliasing",
                    "-fvisibility=hidden", "-Wall"]
    return compile_args, ["-fopenmp", "-lm"]


_compile, _link = _flags()

setup(
    ext_modules=[
        Extension(
            "pocketllm.workers.kernels._cpu_quant",
            sources=sorted(glob.glob(os.path.join(_SRC, "*.c"))),
            depends=sorted(glob.glob(os.path.join(_SRC, "*.h"))),
            include_dirs=[_SRC],
            extra_compile_args=_compile,
            extra_link_args=_link,
            optional=True,
        )
    ]
)
