"""The `pagedkv` command line. Each command lives in the module that does the work; this file only
declares the commands and their options, and turns PagedKVError into a one-line message + exit 2."""

from __future__ import annotations

import functools
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from toolkit.errors import PagedKVError  # noqa: E402

app = typer.Typer(
    help="pagedkv: paged, group-wise quantized KV cache for on-device LLMs "
    "(compile a HF model, export to ExecuTorch/ONNX, run, plan memory, evaluate fidelity).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


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


def main():
    app()


if __name__ == "__main__":
    main()
