"""The kernel core alone, as static binaries: on an Android phone over adb (the NEON paths on real ARM
hardware), or on any aarch64 or x86-64 Linux machine with this repo and Python + numpy (e.g. one with
more cores than ours); the same line parsing and default repetitions as benchmarks/kernels.py's core rows.

    python benchmarks/core_device.py --build             # here: cross-build build/aarch64-bench
    python benchmarks/core_device.py --adb [--serial S]  # a phone with USB debugging on: push, test, measure
    python benchmarks/core_device.py --build --arch x86_64   # build/x86_64-bench
    python benchmarks/core_device.py                     # on that machine: its arch's build/ARCH-bench

qemu (CI) shows that the NEON paths are exact, not how fast they are. This runs on the target CPU itself:
first the core's own tests (toolkit/csrc/pagedkv_core_test: every path against the scalar one), then one
decode step per code path (pagedkv_core_bench: the default spec, random codes, shuffled blocks) for each
dims, ctx and thread count, beside the memory floor of the same step (BENCH_WALK=1: the step's pool bytes
read in the kernel's order, no arithmetic). The binaries are static (g++, Debian's g++-aarch64-linux-gnu for
aarch64; no hosts, no libraries), so they run on Android from /data/local/tmp as they do on Linux.

Prints a markdown table (ms per step, GB/s of KV read, floor / step: 1.0 = the step runs at the speed of
reading its bytes) and writes --json (default benchmarks/results/core_device.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.kernels import core_reps, parse_core_bench  # noqa: E402
from toolkit.deploy import find_adb, list_devices, pick_device  # noqa: E402
from toolkit.errors import PagedKVError  # noqa: E402

COMPILERS = {"aarch64": "aarch64-linux-gnu-g++", "x86_64": "g++"}  # static builds per target arch
BENCH, TEST = "pagedkv_core_bench", "pagedkv_core_test"
REMOTE = "/data/local/tmp/pagedkv-core-bench"  # adb can write and execute there on every Android


class BenchError(PagedKVError):
    """A step of the benchmark failed (its message says which and how to fix it)."""


def build_dir(arch: str) -> Path:
    return REPO / "build" / f"{arch}-bench"


def build(arch: str) -> None:
    """Compiles the core's bench and tests for arch, static (no hosts, no libraries), into build_dir(arch)."""
    out = build_dir(arch)
    cmake = ["cmake", "-S", str(REPO / "toolkit" / "csrc"), "-B", str(out), "-DCMAKE_SYSTEM_NAME=Linux",
             f"-DCMAKE_SYSTEM_PROCESSOR={arch}", f"-DCMAKE_CXX_COMPILER={COMPILERS[arch]}",
             "-DPAGEDKV_BUILD_ET=OFF", "-DPAGEDKV_BUILD_ORT=OFF", "-DCMAKE_EXE_LINKER_FLAGS=-static"]
    print(f"building the core's bench and tests for {arch} (static) into {out} ...", flush=True)
    for cmd in (cmake, ["cmake", "--build", str(out), "-j", str(os.cpu_count() or 1), "--target", BENCH, TEST]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise BenchError(f"`{' '.join(cmd[:3])} ...` failed: {(proc.stderr or proc.stdout).strip()[-800:]} "
                             f"(needs cmake and {COMPILERS[arch]}; Debian: g++-aarch64-linux-gnu for aarch64)")
    print(f"built {out / BENCH} and {out / TEST}")


def built(arch: str) -> list[Path]:
    exes = [build_dir(arch) / BENCH, build_dir(arch) / TEST]
    missing = [str(p) for p in exes if not p.is_file()]
    if missing:
        raise BenchError(f"{', '.join(missing)} not found: run `python benchmarks/core_device.py --build --arch {arch}` "
                         "first")
    return exes


def machine_arch() -> str:
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower(), platform.machine().lower())
    if arch not in COMPILERS:
        raise BenchError(f"this machine is {platform.machine()}: the core builds for {' and '.join(COMPILERS)}; "
                         "use --adb for a phone")
    return arch


class Local:
    """This machine, from the static build for its arch (aarch64: NEON; x86-64: e.g. more cores than ours)."""

    def __init__(self):
        self.dir = build_dir(machine_arch())
        built(machine_arch())

    def run(self, exe: str, args: list, env: dict | None = None) -> str:
        proc = subprocess.run([str(self.dir / exe), *map(str, args)], capture_output=True, text=True,
                              env={**os.environ, **{k: str(v) for k, v in (env or {}).items()}}, timeout=1800)
        if proc.returncode:
            raise BenchError(f"{exe} {' '.join(map(str, args))} failed (exit {proc.returncode}): {proc.stdout[-800:]}"
                             f"{proc.stderr[-400:]}")
        return proc.stdout

    def cpu(self) -> str:
        text = Path("/proc/cpuinfo").read_text()
        return cpu_text(text, platform.node())


class Adb:
    """A phone over adb: the binaries are pushed to REMOTE and run through `adb shell`."""

    def __init__(self, adb: str, serial: str | None):
        path = find_adb(adb)
        self.base = [path, "-s", pick_device(list_devices(path), serial)]
        for exe in built("aarch64"):
            self._adb(["push", str(exe), f"{REMOTE}/{exe.name}"], f"pushing {exe.name}")
        self._adb(["shell", f"chmod 755 {REMOTE}/{BENCH} {REMOTE}/{TEST}"], "making the binaries executable")

    def _adb(self, args: list, what: str) -> str:
        proc = subprocess.run(self.base + args, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise BenchError(f"adb {args[0]} failed (exit {proc.returncode}) while {what}: "
                             f"{(proc.stderr or proc.stdout).strip()[-800:]}")
        return proc.stdout

    def run(self, exe: str, args: list, env: dict | None = None) -> str:
        words = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
        line = " ".join([f"cd {REMOTE} &&", *words, f"./{exe}", *(shlex.quote(str(a)) for a in args)])
        return self._adb(["shell", line], f"running {exe}")

    def cpu(self) -> str:
        model = self._adb(["shell", "getprop ro.product.model; getprop ro.soc.model"], "reading the model").split()
        return cpu_text(self._adb(["shell", "cat /proc/cpuinfo"], "reading /proc/cpuinfo"), " ".join(model))


def cpu_text(cpuinfo: str, name: str) -> str:
    """'<name>: <CPU>, <SIMD features>' from /proc/cpuinfo: ARM CPU parts (one per core cluster) and
    asimddp/i8mm/sve, or the x86 model name and avx2/avx512f/avx512_vnni."""
    models = sorted(set(re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)))
    parts = sorted(set(re.findall(r"^CPU part\s*:\s*(\S+)", cpuinfo, re.M)))
    flags = re.findall(r"^(?:Features|flags)\s*:\s*(.*)$", cpuinfo, re.M)
    have = set(flags[0].split()) if flags else set()
    simd = [f for f in ("asimddp", "i8mm", "sve", "sve2", "avx2", "avx512f", "avx512_vnni") if f in have]
    cpu = " / ".join(models) if models else f"CPU parts {' '.join(parts) or '?'}"
    return f"{name}: {cpu}, {' '.join(simd) or 'none of those SIMD features'}"


def parse_step(out: str) -> tuple[float, int]:
    """(ms, bytes) of one pagedkv_core_bench line (attention or walk), a bad line as a BenchError."""
    try:
        return parse_core_bench(out)
    except RuntimeError as e:
        raise BenchError(str(e)[:300]) from None


def measure(target, ctxs: list, dims: list, threads: list, reps: int | None, only: list | None) -> dict:
    tests = target.run(TEST, [])
    paths = target.run(BENCH, ["--paths"]).split()
    if only:
        missing = [p for p in only if p not in paths]
        if missing:
            raise BenchError(f"--paths {' '.join(missing)}: not on this CPU, which has {' '.join(paths)}")
        paths = only
    rows = []
    for hq, hkv, d in dims:
        for ctx in ctxs:
            for t in threads:
                n = reps or core_reps(ctx)
                args = [ctx, hq, hkv, d, t, n]
                floor_ms = parse_step(target.run(BENCH, args, {"BENCH_WALK": 1}))[0]
                for path in paths:
                    ms, nbytes = parse_step(target.run(BENCH, args + [path]))
                    gbs = nbytes / ms / 1e6  # what the bench prints beside ms, unrounded
                    row = {"path": path, "dims": f"{hq}/{hkv}/{d}", "ctx": ctx, "threads": t, "ms": ms,
                           "gb_s": gbs, "bytes": nbytes, "floor_ms": floor_ms, "floor_over_step": floor_ms / ms}
                    rows.append(row)
                    print(f"| {path} | {row['dims']} | {ctx} | {t} | {ms:.4g} | {gbs:.3g} | {floor_ms:.4g} | "
                          f"{row['floor_over_step']:.2f} |", flush=True)
    return {"paths": paths, "core_test": tests.strip().splitlines()[-2:], "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build build/ARCH-bench here and exit")
    ap.add_argument("--arch", default="aarch64", help="with --build: aarch64 (default; cross) or x86_64")
    ap.add_argument("--adb", action="store_true", help="run on an Android phone over adb")
    ap.add_argument("--serial", help="the phone's serial (`adb devices`) when several are connected")
    ap.add_argument("--adb-path", default="adb", help="the adb executable (default: adb on PATH)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dims", nargs="+", default=["9/3/64", "32/8/128"], help="Hq/Hkv/D (default: SmolLM2's, 32/8/128)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--paths", nargs="+", help="the code paths to time (default: every one the CPU has)")
    ap.add_argument("--reps", type=int, help="timed steps per cell (default: as kernels.py, 20..400 by ctx)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "core_device.json")
    a = ap.parse_args(argv)
    try:
        dims = [tuple(int(x) for x in s.split("/")) for s in a.dims]
        if any(len(d) != 3 or min(d) <= 0 or d[0] % d[1] for d in dims):
            raise ValueError
    except ValueError:
        print(f"core_device.py: --dims {' '.join(a.dims)}: give Hq/Hkv/D, positive, Hq a multiple of Hkv (e.g. 9/3/64)",
              file=sys.stderr)
        return 2
    if min(a.ctx + a.threads + [a.reps or 1]) <= 0:
        print("core_device.py: --ctx, --threads and --reps must be positive", file=sys.stderr)
        return 2
    try:
        if a.build:
            if a.arch not in COMPILERS:
                raise BenchError(f"--arch {a.arch}: use {' or '.join(COMPILERS)}")
            build(a.arch)
            return 0
        target = Adb(a.adb_path, a.serial) if a.adb else Local()
        cpu = target.cpu()
        print(f"{cpu}\n\n| path | Hq/Hkv/D | ctx | threads | ms | GB/s | floor ms | floor / step |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
        out = {"cpu": cpu, "where": "adb" if a.adb else "local", **measure(target, a.ctx, dims, a.threads, a.reps, a.paths)}
    except PagedKVError as e:
        print(f"core_device.py: {e}", file=sys.stderr)
        return 2
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"core tests: {' / '.join(out['core_test'])}\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
