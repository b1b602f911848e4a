"""The app's runner and the desktop engine on the same .pte: the same greedy tokens after a long prompt.

    python benchmarks/runner_vs_desktop.py ART_DIR --ctx 8192 --decode 64 \
        --json benchmarks/results/runner_vs_desktop_qwen2.5_8k.json

ART_DIR: artifacts exported with `pagedkv export --format pte` (e.g. the ones benchmarks/device.py made).
The prompt is the first --ctx tokens of wikitext-2 (test), as pagedkv-runner takes them from --prompt-file
(the tokenizer's post-processor tokens included); the runner (android_demo/native, C++) and
runtime_sim's ExecuTorch engine (Python) each prefill it and decode --decode greedy tokens, one thread
each, one after the other. Both run the same program on the same pool format, so every token must be
equal; the first position where they differ is reported otherwise (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_TEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
RUNNER = REPO / "build" / "android-host" / "pagedkv-runner"


def prompt_ids(art: Path, text: Path, ctx: int) -> list[int]:
    """The first ctx tokens of the text, encoded as the runner encodes its --prompt-file (a prefix of
    8 x ctx characters, doubled until it holds more than ctx tokens; no newline translation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(art))
    raw = text.read_bytes().decode("utf-8")  # the bytes the runner reads: wikitext's CRLFs kept
    chars = 8 * ctx
    while True:
        ids = tok(raw[:chars])["input_ids"]
        if len(ids) > ctx or chars >= len(raw):
            break
        chars *= 2
    if len(ids) < ctx:
        raise SystemExit(f"{text} has only {len(ids)} tokens, fewer than --ctx {ctx}")
    return ids[:ctx]


def run_runner(runner: Path, art: Path, text: Path, ctx: int, decode: int) -> dict:
    cmd = [str(runner), str(art), "--prompt-file", str(text), "--ctx", str(ctx), "--decode", str(decode),
           "--threads", "1", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise SystemExit(f"pagedkv-runner failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_desktop(art: Path, ids: list[int], decode: int) -> tuple[list[int], float]:
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(art, "executorch", threads=1)  # ExecuTorch's threadpool, as the runner's --threads 1
    t = time.time()
    out = list(engine.generate(engine.new_conversation(), ids, max_new_tokens=decode))
    return out, time.time() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("art", type=Path, help="artifacts dir with a .pte (pagedkv export --format pte)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--runner", type=Path, default=RUNNER, help="pagedkv-runner (bash android_demo/native/ci_build.sh host)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    a = ap.parse_args(argv)
    if not a.runner.is_file():
        raise SystemExit(f"{a.runner} is missing: build it with `bash android_demo/native/ci_build.sh host`")

    t = time.time()
    runner = run_runner(a.runner, a.art, a.text, a.ctx, a.decode)
    runner_s = time.time() - t
    print(f"runner: {len(runner['generated'])} tokens in {runner_s:.0f} s", flush=True)
    ids = prompt_ids(a.art, a.text, a.ctx)
    desktop, desktop_s = run_desktop(a.art, ids, a.decode)
    print(f"desktop (runtime_sim, executorch): {len(desktop)} tokens in {desktop_s:.0f} s", flush=True)
    same = runner["generated"] == desktop
    first_diff = next((i for i, (x, y) in enumerate(zip(runner["generated"], desktop)) if x != y), None)
    result = {"art": str(a.art), "ctx": a.ctx, "decode": a.decode, "equal": same, "first_difference": first_diff,
              "runner_tokens": runner["generated"], "desktop_tokens": desktop, "runner_seconds": round(runner_s, 1),
              "desktop_seconds": round(desktop_s, 1), "isa": runner.get("isa"),
              "command": "python benchmarks/runner_vs_desktop.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"greedy tokens after a {a.ctx}-token prompt: " + ("equal" if same else
          f"DIFFER from position {first_diff} ({len(runner['generated'])} vs {len(desktop)} tokens)"))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
