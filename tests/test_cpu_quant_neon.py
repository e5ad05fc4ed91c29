"""The CPU kernels' ARM NEON variant (kernels_neon.c), emulated: the library's C sources and
tests/c/neon_check.c cross-compiled for aarch64 (Debian's gcc-aarch64-linux-gnu, static) and
run under qemu-user. The driver compares every product on the neon variant with the scalar
one and with a float64 reference (the bounds of test_cpu_quant_kernels.py), and dumps its
dequantized rows, which must match the numpy reference bit for bit.

Skipped where the cross compiler or qemu-aarch64 is missing (CI has neither). Install:
``apt-get install gcc-aarch64-linux-gnu qemu-user``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

from pocketllm.workers.loader.gguf_quants import GGML_TYPES, dequantize

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SRC = os.path.join(_ROOT, "workers", "kernels", "cpu_quant")
_DRIVER = os.path.join(_ROOT, "tests", "c", "neon_check.c")
_CC = shutil.which("aarch64-linux-gnu-gcc")
_QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")

pytestmark = pytest.mark.skipif(
    _CC is None or _QEMU is None,
    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 on PATH "
    "(apt-get install gcc-aarch64-linux-gnu qemu-user)")

# setup.py's flags (OpenMP included: the driver runs 1 and 2 threads), statically linked
_FLAGS = ["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
          "-fno-strict-aliasing", "-Wall"]
_NAMES = {name: t for t, (name, _, _) in GGML_TYPES.items()}


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> str:
    exe = str(tmp_path_factory.mktemp("neon") / "neon_check")
    sources = sorted(glob.glob(os.path.join(_SRC, "*.c"))) + [_DRIVER]
    build = subprocess.run([_CC, *_FLAGS, "-static", "-I", _SRC, *sources, "-o", exe, "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    # the variant's own file must compile cleanly (the link's static-glibc notes aside)
    assert "kernels_neon.c" not in build.stderr, build.stderr
    return exe


def _run(exe: str, *args: str, isa: str | None = None, timeout: int = 240):
    env = {k: v for k, v in os.environ.items() if k != "POCKETLLM_CPU_ISA"}
    if isa is not None:
        env["POCKETLLM_CPU_ISA"] = isa
    return subprocess.run([_QEMU, exe, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def checked(driver, tmp_path_factory):
    dump = tmp_path_factory.mktemp("neon-dump")
    run = _run(driver, str(dump))
    return run, dump


def test_neon_is_chosen_on_aarch64_and_can_be_forced(driver):
    lines = _run(driver, "--isa").stdout.splitlines()
    assert lines[:3] == ["isa neon", "all neon,scalar", "supported neon,scalar"]
    assert _run(driver, "--isa", isa="scalar").stdout.splitlines()[0] == "isa scalar"
    assert _run(driver, "--isa", isa="neon").stdout.splitlines()[0] == "isa neon"
    assert _run(driver, "--isa", isa="avx2").stdout.splitlines()[0] == "isa "  # absent: refused


def test_neon_products_match_scalar_and_float64(checked):
    run, _ = checked
    hint = ("" if run.returncode >= 0 else
            f"\nthe driver died of signal {-run.returncode}: does every entry of pq_isa_impl "
            "(kernels.h) have a NEON implementation in kernels_neon.c?")
    assert run.returncode == 0 and "PASS:" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:] + hint
    for name, (_, elems, _) in GGML_TYPES.items():
        if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                    "IQ4_NL", "IQ4_XS"):
            assert f"mul_mat {name:<6} worst" in run.stdout, name  # every type was multiplied


def test_aarch64_dequantize_rows_is_bit_exact(checked):
    """The decoders as compiled for aarch64 (-ffp-contract=off: no fused multiply-adds) give
    the numpy reference's bits; with special fp16 scales (zero, subnormal, huge, inf, nan),
    the same bits wherever the reference is not nan, and nan where it is."""
    run, dump = checked
    assert run.returncode == 0, run.stdout[-2000:]
    files = sorted(glob.glob(os.path.join(dump, "*.w")))
    seen = set()
    for wpath in files:
        base = os.path.basename(wpath)[:-2]  # TYPE_K.tag
        name_k, tag = base.rsplit(".", 1)
        name, k = name_k.rsplit("_", 1)
        ggml_type, k = _NAMES[name], int(k)
        raw = np.fromfile(wpath, dtype=np.uint8)
        out = np.fromfile(wpath[:-2] + ".f", dtype=np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            ref = dequantize(raw, ggml_type)
        assert out.shape == ref.shape, base
        if tag == "rand":
            assert np.array_equal(out.view(np.int32), ref.view(np.int32)), base
        else:
            nan = np.isnan(ref)
            assert np.array_equal(np.isnan(out), nan), base
            assert np.array_equal(out.view(np.int32)[~nan], ref.view(np.int32)[~nan]), base
        seen.add((name, tag))
    names = {n for n, _ in seen}
    assert len(names) == 12 and {t for _, t in seen} == {"rand", "special"}, sorted(seen)
