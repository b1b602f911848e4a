"""The Android app's logic that does not need Android (android_demo/app/src/main/java/org/pagedkv/demo/core:
pool budget and trim policy, thread count, transcript and turn state, model import checks, ChatEngine),
compiled with the Kotlin compiler from npm (`kotlin-compiler`, pinned below) and run on the host JVM; the
ChatEngine part against the real native runner (host build of libpagedkv_jni.so) on the tiny .pte. Also the
Gradle project's toolchain pins. The Activity and PagedKVApp (Android classes) are not compiled here.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.native_build import run, tiny_pte_fixtures

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "android_demo" / "app"
NATIVE = REPO / "android_demo" / "native"
CORE = APP / "src" / "main" / "java" / "org" / "pagedkv" / "demo" / "core"
HOST_TESTS = APP / "src" / "test" / "kotlin" / "org" / "pagedkv" / "demo" / "core" / "HostTests.kt"
KOTLIN_VERSION = "2.1.20"  # the app's Kotlin (android_demo/build.gradle.kts)
KOTLINC_DIR = REPO / "build" / "kotlinc"
OUT = REPO / "build" / "android-app-jvm"



def kotlin_home() -> Path:
    """kotlin-compiler from npm into build/kotlinc (once); needs npm and a JDK."""
    home = KOTLINC_DIR / "node_modules" / "kotlin-compiler"
    if not (home / "bin" / "kotlinc").is_file() or json.loads((home / "package.json").read_text())["version"] != KOTLIN_VERSION:
        if shutil.which("npm") is None:
            pytest.fail("npm is not installed: apt-get install -y npm (the Kotlin compiler comes from npm)")
        run(["npm", "install", "--no-audit", "--no-fund", "--prefix", KOTLINC_DIR, f"kotlin-compiler@{KOTLIN_VERSION}"],
            timeout=600)
    return home


@pytest.fixture(scope="module")
def classes():
    """javac NativeRunner & co, then kotlinc the core classes + HostTests; cached by the sources' hash."""
    if shutil.which("javac") is None or shutil.which("java") is None:
        pytest.fail("a JDK is missing: apt-get install -y openjdk-17-jdk-headless")
    home = kotlin_home()
    java_src = sorted((NATIVE / "java").rglob("*.java"))
    kt_src = sorted(CORE.glob("*.kt")) + [HOST_TESTS]
    digest = hashlib.sha256()
    for p in java_src + kt_src:
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    key = digest.hexdigest()[:16]
    stamp = OUT / "sources.sha256"
    jcls, kcls = OUT / "java", OUT / "kotlin"
    if not (stamp.is_file() and stamp.read_text() == key):
        shutil.rmtree(OUT, ignore_errors=True)
        jcls.mkdir(parents=True)
        run(["javac", "-d", jcls, *java_src])
        run([home / "bin" / "kotlinc", "-jvm-target", "17", "-Werror", "-d", kcls, "-cp", jcls, *kt_src], timeout=1200)
        stamp.write_text(key)
    return [kcls, jcls, home / "lib" / "kotlin-stdlib.jar"]


def host_tests(classes, *args, min_passed: int = 1, timeout: int = 900) -> str:
    """Runs HostTests.kt's main (on the host JVM, with the host runner's JNI library) and returns its output;
    fails with its FAIL lines first, since they may lie far before the output's tail."""
    cmd = ["java", f"-Djava.library.path={REPO / 'build' / 'android-host'}", "-cp", ":".join(map(str, classes)),
           "org.pagedkv.demo.core.HostTestsKt", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    fails = "\n".join(line for line in out.splitlines() if line.startswith("FAIL "))
    m = re.findall(r"^(\d+) passed, (\d+) failed$", out, re.M)
    ok = bool(m) and int(m[-1][1]) == 0 and int(m[-1][0]) >= min_passed and proc.returncode == 0
    assert ok, f"HostTests exit {proc.returncode}:\n{fails}\n--- tail ---\n{out[-3000:]}"
    return out


def test_app_logic_on_host_jvm(classes):
    host_tests(classes, min_passed=40)


@pytest.fixture(scope="module")
def runner_fixtures(tmp_path_factory, wikitext, tiny_pte_fp32):
    """The tiny .pte (make_fixtures.py) twice: as exported, and with a chat template and stop ids in its
    manifest (the fields export writes into pagedkv.json)."""
    out = tmp_path_factory.mktemp("android-app-fixtures")
    shutil.copytree(tiny_pte_fp32, out / "plain")  # conftest's shared export, copied
    shutil.copytree(out / "plain", out / "templated")
    path = out / "templated" / "artifacts" / "pagedkv.json"
    m = json.loads(path.read_text())
    m["chat_template"] = ("{% for m in messages %}{{ '<s>' + m['role'] + ': ' + m['content'] | trim + '</s>\n' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}")
    m["stop_token_ids"] = [2]
    path.write_text(json.dumps(m))
    # a compact region of 8 blocks (issue 25's compact tier), as tests/test_runner_ladder.py exports it
    tiny_pte_fixtures(out / "compact", wikitext, "--spec", "default", "--compact-blocks", "8")
    return out


@pytest.mark.parametrize("which", ["plain", "templated", "compact"])
def test_chat_engine_with_the_native_runner(classes, runner_fixtures, which):
    subprocess.run(["bash", str(NATIVE / "ci_build.sh"), "host"], check=True, capture_output=True, timeout=1800)
    out = host_tests(classes, runner_fixtures / which, timeout=600)
    assert "PASS a Stop before the turn starts is not lost" in out, out[-4000:]
    assert "PASS start restores the saved chat without prefill" in out, out[-4000:]  # HostTests saveRestoreTests
    # HostTests compactTrimTests: trim compacts on a .pte with a compact region, skips it on one without
    if which == "compact":
        assert "PASS trim compacts aged blocks" in out and "PASS the restored compacted chat continues" in out, out[-4000:]
        assert "PASS the restored compacted cache gives the same greedy tokens" in out, out[-4000:]
    else:
        assert "PASS trim without a compact region skips compaction" in out, out[-4000:]
        assert "PASS compact on a .pte without a compact region throws" in out, out[-4000:]


def test_gradle_toolchain_pins():
    """The versions the app README lists are the ones the build files use."""
    props = (REPO / "android_demo" / "gradle" / "wrapper" / "gradle-wrapper.properties").read_text()
    gradle = tuple(map(int, re.search(r"gradle-(\d+)\.(\d+)(?:\.\d+)?-bin\.zip", props).groups()))
    assert gradle >= (8, 11)
    top = (REPO / "android_demo" / "build.gradle.kts").read_text()
    agp = tuple(map(int, re.search(r'"com\.android\.application"\) version "(\d+)\.(\d+)', top).groups()))
    kotlin = int(re.search(r'"org\.jetbrains\.kotlin\.android"\) version "(\d+)\.', top).group(1))
    assert agp >= (8, 9) and kotlin >= 2
    assert f'version "{KOTLIN_VERSION}"' in top
    app = (APP / "build.gradle.kts").read_text()
    assert 'ndkVersion = "28.2.13676358"' in app  # r28c
    assert re.search(r'version = "3\.31\.\d+"', app)
    assert "-DANDROID_STL=c++_static" in app and "max-page-size=16384" in app and "-DPAGEDKV_EXECUTORCH=source" in app
    assert "org.pytorch:executorch-android" not in app and "pickFirsts" not in app  # no AAR, no shared STL copies
    readme = (REPO / "android_demo" / "README.md").read_text()
    for v in ("8.11.1", "8.9.1", KOTLIN_VERSION, "28.2.13676358", "3.31.6", "v1.5.1"):
        assert v in readme, v
