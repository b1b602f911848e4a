"""llama.cpp, the peer every benchmark compares with: one build per instruction set, matched to ours.

llama-cpp-python is built from source into its own venv, ~/.cache/pagedkv/llamacpp-<isa>-venv, the
first time a benchmark needs it (~7-10 min on 2 cores). <isa> is the widest path our kernel takes on
this CPU: `avx512` (AVX-512 with VNNI) on CPUs that have it, else `avx2`, so that both sides of a
comparison use the same instruction set. AMX stays off (it dies with SIGILL on these VMs) and
GGML_NATIVE is off (the flags are explicit). The venv records its build flags in
pagedkv-cmake-args.txt; a venv built with other flags is rebuilt.

Standard library only: the benchmarks import it before any heavy package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

LLAMACPP_PKG = "llama-cpp-python==0.3.36"
_COMMON = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF "
           "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
LLAMACPP_CMAKE = {
    "avx512": _COMMON + " -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON",
    "avx2": _COMMON + " -DGGML_AVX512=OFF",
}


def cache_root() -> Path:
    root = os.environ.get("PAGEDKV_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pagedkv"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def llamacpp_isa() -> str:
    """The build that matches our kernel's best path on this CPU."""
    return "avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else "avx2"


def default_venv() -> Path:
    return cache_root() / f"llamacpp-{llamacpp_isa()}-venv"


def llamacpp_python(venv: Path | None = None) -> Path:
    return (venv or default_venv()) / "bin" / "python"


def _tail(text: str, n: int = 4) -> str:
    return " | ".join([x for x in text.strip().splitlines() if x.strip()][-n:])


def ensure_llamacpp(venv: Path | None = None) -> tuple[bool, str]:
    """(True, version) once llama_cpp imports in venv (built with this CPU's flags), else (False, why)."""
    venv = venv or default_venv()
    want = LLAMACPP_CMAKE[llamacpp_isa()]
    py = llamacpp_python(venv)
    probe = [str(py), "-c", "import llama_cpp, numpy; print(llama_cpp.__version__)"]
    marker = venv / "pagedkv-cmake-args.txt"
    if py.exists() and marker.is_file() and marker.read_text().strip() == want:
        r = subprocess.run(probe, capture_output=True, text=True)
        if r.returncode == 0:
            return True, r.stdout.strip()
    print(f"[llama.cpp {time.strftime('%H:%M:%S')}] building {LLAMACPP_PKG} into {venv} with CMAKE_ARGS='{want}' "
          "(~7-10 min on 2 cores; the benchmarks' --skip-llamacpp skips it)", file=sys.stderr, flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_ARGS=want, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    logf = venv / "build.log"
    with open(logf, "w") as f:
        p = subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", LLAMACPP_PKG,
                            "numpy"], stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0:
        return False, f"pip install {LLAMACPP_PKG} failed (exit {p.returncode}): {_tail(logf.read_text())} (log: {logf})"
    marker.write_text(want + "\n")
    r = subprocess.run(probe, capture_output=True, text=True)
    return (True, r.stdout.strip()) if r.returncode == 0 else (False, f"llama_cpp does not import: {_tail(r.stderr)}")


def build_flags() -> str:
    return LLAMACPP_CMAKE[llamacpp_isa()]
