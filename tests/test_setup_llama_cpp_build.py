"""The llama.cpp that `make setup` builds runs on any x86-64 machine, not only the one that compiled it.

A build with llama.cpp's default ``-march=native`` on a VM whose CPU reports AVX-512 and AMX emits those
instructions; a VM that does not let a process use them kills the server with SIGILL on its first
completion. The Makefile builds with ``GGML_NATIVE=OFF`` (an AVX2/FMA baseline); this test reads the
installed libraries' machine code and fails on any AVX-512 (zmm registers) or AMX (tile) instruction.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

NOT_PORTABLE = ("zmm", "tileloadd", "tdpbf16ps", "tdpbssd", "ldtilecfg")


def _libraries() -> list[Path]:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    return sorted(p for p in lib.glob("libggml*.so") if p.is_file())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets only")
def test_installed_llama_cpp_has_no_avx512_or_amx_instructions() -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump (Debian's binutils, installed with gcc) is needed to read the llama.cpp build")
    libs = _libraries()
    assert libs, "no libggml*.so under llama_cpp/lib: is llama-cpp-python installed by make setup?"
    found = {}
    for lib in libs:
        code = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], check=True, capture_output=True,
                              text=True).stdout
        hits = [w for w in NOT_PORTABLE if w in code]
        if hits:
            found[lib.name] = hits
    assert not found, (f"llama.cpp was built for this CPU only ({found}); rebuild it portable: "
                       "rm -rf .venv ~/.cache/eagle3-pipeline/wheels && make setup")
