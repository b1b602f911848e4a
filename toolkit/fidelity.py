"""How much a KV spec changes a model's predictions: perplexity, KL divergence and top-1 agreement
against the unquantized pool, teacher-forced over windows of a text.

    result = evaluate(model, tokenizer, text, ctx=512, specs=["default", "q8_0-q4_0"], windows=8)

Method (the numbers in DESIGN.md were measured the same way):
- tokenize the whole text without special tokens and cut `windows` consecutive, non-overlapping
  windows of `ctx` tokens from the start; with a BOS id (by default when the tokenizer adds one, as
  Gemma's does), each window's first token is replaced by BOS, as llama.cpp's perplexity does;
- run each window through the paged model in ONE call (positions 0..ctx-1, sequence 0, block
  table 0..ctx/block_size-1), once per spec, with the pool zeroed before every call;
- the reference is the unquantized "fp32" pool (always the first row; KLD 0, agreement 1);
- over the ctx-1 positions of a window that have a next token: PPL = exp(mean NLL of the next
  token), KLD(ref || spec) averaged over positions, top-1 = share of positions whose argmax
  equals the reference's. All windows are pooled (PPL is over all their predictions).

A spec is a preset name ("default", "q8_0-q4_0", ...) or a preset with field overrides,
"default:v_group=16,v_sym=true" (fields of KVQuantSpec), which names the row as written.

Extra rows (`extra_rows=[...]`: objects with name, spec, info and window_logits(window) -> logits;
runtime_sim.eval_artifacts.open_artifact makes one per exported artifacts dir, as `pagedkv eval MODEL
--artifacts DIR` does) are scored the same way against the same reference rows: the windows run through the artifact's own
runtime (runtime_sim's Engine on onnxruntime or ExecuTorch, as the chat runs it: prefill in chunks of
the engine's prefill size, the pool laid out as the manifest says), so a row shows what the weight
format (fp32 / int4 / int4-e4 / 8da4w ...) and the exported KV spec cost together. The artifact must
have been exported from the reference model (toolkit.manifest.check_same_model).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from toolkit.errors import PagedKVError, SpecError
from toolkit.kv_spec import DEFAULT_SPECS, parse_spec  # noqa: F401  (part of this module's interface)
from toolkit.quant import bytes_per_token, fp16_bytes_per_token

REFERENCE = "fp32"


# ----------------------------------------------------------------------------------------------
# Evaluation


def tokenize(tokenizer, text: str) -> list[int]:
    """The text's token ids, without BOS or any other special token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text (Gemma, Llama 2/3), or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return bos if ids[:1] == [bos] else None


def _window_logits(paged, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    t = ids.numel()
    paged.reset_pool()
    tables = torch.arange(paged.layout.num_blocks, dtype=torch.int64)[None, :]
    with torch.no_grad():
        logits = paged(ids[None], torch.arange(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64), tables)
    return logits[0].float()


def _model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model"))


def _op_kernel(kernel: str):
    """The context the windows run in: the op on the native core, or the PyTorch reference."""
    if kernel == "reference":
        return contextlib.nullcontext()
    if kernel != "native":
        raise PagedKVError(f"kernel={kernel!r}: use 'native' (the C++ core) or 'reference' (plain PyTorch).")
    from toolkit.native_op import native_op

    return native_op()


def evaluate_ids(
    model,
    ids,
    ctx: int,
    specs: list,
    windows: int,
    block_size: int = 16,
    model_name: str | None = None,
    progress: bool = True,
    bos_id: int | None = None,
    kernel: str = "native",
    extra_rows: list | None = None,
    key_offsets: list | None = None,
) -> dict:
    """Like `evaluate`, on token ids already cut from a text (no tokenizer needed); bos_id replaces
    each window's first token. extra_rows: one row each after the specs' (an exported artifact:
    runtime_sim.eval_artifacts.open_artifact; its row also has the row's `info`: "artifact", "format",
    "weights", "kv_spec", "weights_file_bytes", "backend")."""
    from toolkit.compiler import compile, model_dims  # heavy import (transformers)

    ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    if ctx < 2:
        raise PagedKVError(f"--ctx {ctx} is too short: a window needs at least 2 tokens to predict one.")
    if windows < 1:
        raise PagedKVError(f"--windows {windows}: evaluate at least one window.")
    if ids.numel() < ctx * windows:
        raise PagedKVError(
            f"the text has {ids.numel()} tokens, fewer than {windows} window(s) x ctx {ctx} = {ctx * windows}: "
            "use a longer text, fewer --windows or a smaller --ctx."
        )
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos and ctx > max_pos:
        raise PagedKVError(f"--ctx {ctx} exceeds the model's max_position_embeddings={max_pos}: use a smaller --ctx.")

    rows = [parse_spec(REFERENCE)] + [parse_spec(s) for s in specs if s != REFERENCE]
    names = [n for n, _ in rows]
    if len(set(names)) != len(names):
        raise SpecError(f"a spec is listed twice in {names}: list each once.")
    dims = model_dims(model.config)
    for name, spec in rows:
        try:
            spec.validate(dims.head_dim)
        except SpecError as e:
            raise SpecError(f"spec '{name}': {e}") from None
    arts = list(extra_rows or [])
    num_blocks = -(-ctx // block_size)
    # one block table for all layers (groups=False): a window of ctx tokens needs every block anyway
    paged = {name: compile(model, spec, block_size=block_size, num_blocks=num_blocks, max_seqs=1, groups=False,
                           key_offsets=key_offsets)
             for name, spec in rows}
    runners = [(name, functools.partial(_window_logits, paged[name], block_size=block_size)) for name, _ in rows]
    runners += [(a.name, a.window_logits) for a in arts]
    if len({name for name, _ in runners}) != len(runners):
        raise PagedKVError(f"an artifact is listed twice in {[name for name, _ in runners]}: list each once.")
    with _op_kernel(kernel):
        nll, kld, agree, count = score_windows(runners, ids, ctx, windows, bos_id, progress)

    fp16 = fp16_bytes_per_token(dims.num_kv_heads, dims.head_dim, dims.num_layers)
    ppl = torch.exp(nll / count)
    results = []
    entries = [(name, spec, {}) for name, spec in rows] + [(a.name, a.spec, a.info) for a in arts]
    for i, (name, spec, extra) in enumerate(entries):
        results.append(
            {
                "spec": name,
                "bytes_per_token_vs_fp16": round(
                    bytes_per_token(spec, dims.num_kv_heads, dims.head_dim, dims.num_layers) / fp16, 4
                ),
                "ppl": round(float(ppl[i]), 4),
                "ppl_increase_pct": round(float((ppl[i] / ppl[0] - 1) * 100), 4),
                "kld_mean": float(f"{float(kld[i] / count):.6g}"),
                "top1_agreement": round(float(agree[i] / count), 5),
                **extra,
            }
        )
    return {"model": model_name or _model_name(model), "ctx": ctx, "bos": bos_id is not None, "results": results}


ROWS_PER_CHUNK = 256  # logits rows scored at once: a [ctx, vocab] temporary of Gemma 3's 262k vocabulary
#                       at ctx 4096 is 4 GiB, and the KLD took four of them


def _score_rows(logits: torch.Tensor, target: torch.Tensor, ref_logp: torch.Tensor) -> tuple[float, float, float]:
    """(NLL sum, KLD sum against ref_logp, top-1 agreements with it) of one window's logits rows, scored
    ROWS_PER_CHUNK rows at a time."""
    nll = kld = agree = 0.0
    for a in range(0, logits.shape[0], ROWS_PER_CHUNK):
        b = min(a + ROWS_PER_CHUNK, logits.shape[0])
        logp, ref = torch.log_softmax(logits[a:b].float(), dim=-1), ref_logp[a:b]
        nll += float(-logp.gather(1, target[a:b, None]).sum(dtype=torch.float64))
        kld += float((ref.exp() * (ref - logp)).sum(dtype=torch.float64))
        agree += float((logp.argmax(-1) == ref.argmax(-1)).sum())
    return nll, kld, agree


def score_windows(runners, ids: torch.Tensor, ctx: int, windows: int, bos_id: int | None = None,
                  progress: bool = True):
    """The metrics of every row over the windows: runners is [(name, window -> logits [ctx, vocab])],
    the first one the reference. Returns per-row sums (nll, kld, top-1 agreements) and the count of
    predictions: PPL = exp(nll / count), KLD = kld / count, top-1 = agree / count."""
    n = len(runners)
    nll = torch.zeros(n, dtype=torch.float64)
    kld = torch.zeros(n, dtype=torch.float64)
    agree = torch.zeros(n, dtype=torch.float64)
    count = 0
    progress_bar = _progress(progress)
    with progress_bar as bar:
        task = bar.add_task("fidelity", total=n * windows) if bar else None
        for w in range(windows):
            window = ids[w * ctx : (w + 1) * ctx]
            if bos_id is not None:
                window = torch.cat((torch.tensor([bos_id]), window[1:]))
            target = window[1:]
            ref_logp = None
            for i, (name, run) in enumerate(runners):
                if bar:
                    bar.update(task, description=f"ctx {ctx} window {w + 1}/{windows} {name}")
                logits = run(window)
                if i == 0:  # the reference's log-probs, kept for the other rows' KLD and top-1
                    ref_logp = torch.log_softmax(logits[:-1].float(), dim=-1)
                    nll[0] += float(-ref_logp.gather(1, target[:, None]).sum(dtype=torch.float64))
                    agree[0] += float(target.numel())
                else:
                    n_i, k_i, a_i = _score_rows(logits[:-1], target, ref_logp)
                    nll[i] += n_i
                    kld[i] += k_i
                    agree[i] += a_i
                del logits
                if bar:
                    bar.advance(task)
            count += target.numel()
            if bar and not bar.console.is_terminal:  # a log file gets one line per window instead of a bar
                bar.console.print(f"ctx {ctx}: window {w + 1}/{windows} done, {bar.tasks[0].elapsed:.0f} s")
    return nll, kld, agree, count


def spec_name(spec) -> str:
    """A preset's name when the spec is one, else its description."""
    from toolkit.kv_spec import PRESETS

    return next((name for name, p in PRESETS.items() if p == spec), spec.describe())


def evaluate(
    model,
    tokenizer,
    text: str,
    ctx: int,
    specs: list,
    windows: int,
    block_size: int = 16,
    model_name: str | None = None,
    progress: bool = True,
    bos: bool | None = None,
    kernel: str = "native",
    extra_rows: list | None = None,
    key_offsets: list | None = None,
) -> dict:
    """Teacher-forced fidelity of each KV spec vs the fp32 pool over `windows` windows of `ctx` tokens.

    Returns {"model", "ctx", "results": [{"spec", "bytes_per_token_vs_fp16", "ppl", "ppl_increase_pct",
    "kld_mean", "top1_agreement"}, ...]} with the "fp32" reference row first.
    bos: put the tokenizer's BOS first in every window (None: when the tokenizer adds one itself).
    kernel: "native" runs the op on the C++ core (toolkit.native_op, built by `make native`; minutes
    instead of tens of minutes on a real model), "reference" on the plain-PyTorch op (its definition).
    key_offsets: per-layer key offsets the quantized rows subtract (toolkit/key_offsets.py, as export does).
    """
    ids = tokenize(tokenizer, text)
    bos_id = tokenizer_bos(tokenizer)
    if bos and bos_id is None:
        bos_id = getattr(tokenizer, "bos_token_id", None)
        if bos_id is None:
            raise PagedKVError("--bos: the tokenizer has no BOS token; leave --bos out.")
    if bos is False:
        bos_id = None
    return evaluate_ids(model, ids, ctx, specs, windows, block_size, model_name, progress, bos_id, kernel, extra_rows,
                        key_offsets)


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=Console(stderr=True), transient=False,
    )


# ----------------------------------------------------------------------------------------------
# Presentation


COLUMNS = ("spec", "bytes_per_token_vs_fp16", "ppl", "ppl_increase_pct", "kld_mean", "top1_agreement")
HEADERS = ("spec", "bytes vs fp16", "PPL", "PPL +%", "KLD", "top-1")


def format_row(r: dict) -> list[str]:
    return [
        r["spec"],
        f"{r['bytes_per_token_vs_fp16']:.3f}x",
        f"{r['ppl']:.3f}",
        f"{r['ppl_increase_pct']:+.3f}%",
        f"{r['kld_mean']:.5f}",
        f"{100 * r['top1_agreement']:.2f}%",
    ]


def rich_table(result: dict, title: str | None = None):
    from rich.table import Table

    table = Table(title=title or f"{result['model']} - ctx {result['ctx']}")
    for h in HEADERS:
        table.add_column(h, justify="left" if h == "spec" else "right")
    for r in result["results"]:
        table.add_row(*format_row(r))
    return table


def markdown_table(result: dict) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(HEADERS) - 1)) + "|"]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in result["results"]]
    return "\n".join(lines)


def timed_evaluate(*args, **kwargs) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = evaluate(*args, **kwargs)
    return out, time.perf_counter() - t0


__all__ = [
    "DEFAULT_SPECS", "REFERENCE", "evaluate", "evaluate_ids", "markdown_table", "parse_spec", "rich_table",
    "score_windows", "spec_name", "tokenize", "timed_evaluate",
]
