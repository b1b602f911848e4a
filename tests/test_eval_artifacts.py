"""`pagedkv eval --artifacts`: exported artifacts (tiny llama, ONNX on onnxruntime) scored against the
same fp32-pool reference rows as the KV specs, and hostile artifacts dirs refused with one line."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from export.artifacts import PoolRequest, export_artifacts
from tests.test_model_loading import WORDS, save_tiny_hf_dir, tiny_tokenizer
from toolkit.cli import app
from toolkit.errors import ArtifactError
from runtime_sim.eval_artifacts import open_artifact
from toolkit.fidelity import evaluate_ids
from toolkit.manifest import read_manifest, write_manifest
from toolkit.model_loading import load_model
from toolkit.tiny_models import tiny_model

CTX, WINDOWS = 48, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny llama HF dir, exported four ways (each ONNX export takes ~15 s)."""
    d = tmp_path_factory.mktemp("eval-artifacts")
    save_tiny_hf_dir(d / "m")
    other = tiny_model("llama", seed=1)  # same architecture and sizes, other weights
    other.save_pretrained(d / "other-model")
    tiny_tokenizer().save_pretrained(d / "other-model")

    def export(name, model_dir, spec, weights="fp32", pool_tokens=128):
        export_artifacts(str(d / model_dir), d / name, ("onnx",), spec, PoolRequest(pool_tokens=pool_tokens, max_seqs=1),
                         onnx_weights=weights, accept_fidelity=True)
        return d / name

    arts = {
        "fp32": export("fp32", "m", "fp32"),
        "int4": export("int4", "m", "fp32", weights="int4"),
        "small-pool": export("small-pool", "m", "default", pool_tokens=32),
        "other": export("other", "other-model", "fp32"),
    }
    gen = torch.Generator().manual_seed(1)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (CTX * WINDOWS + 20,), generator=gen)]
    (d / "t.txt").write_text(" ".join(words))
    return d, arts


def _eval(setup, artifacts, specs=()):
    d, _ = setup
    model, tok = load_model(str(d / "m"))
    ids = tok((d / "t.txt").read_text(), add_special_tokens=False)["input_ids"]
    rows = [open_artifact(a, model, str(d / "m"), CTX) for a in artifacts]
    return evaluate_ids(model, ids, CTX, list(specs), WINDOWS, model_name=str(d / "m"), progress=False,
                        extra_rows=rows)


def test_fp32_export_equals_the_reference_and_int4_costs_a_stable_kld(setup):
    _, arts = setup
    res = _eval(setup, [arts["fp32"], arts["int4"]])
    ref, fp32, int4 = res["results"]
    assert ref["spec"] == "fp32" and fp32["spec"] == "onnx fp32 / fp32" and int4["spec"] == "onnx int4 / fp32"
    assert (fp32["weights"], fp32["kv_spec"], fp32["format"], fp32["backend"]) == ("fp32", "fp32", "onnx",
                                                                                  "onnxruntime")
    assert int4["weights"] == "int4" and int4["weights_file_bytes"] < fp32["weights_file_bytes"] / 2
    # fp32 weights and an fp32 pool through onnxruntime (chunked prefill): the PyTorch reference's numbers
    assert fp32["ppl"] == pytest.approx(ref["ppl"], rel=2e-5)
    assert abs(fp32["kld_mean"]) < 1e-6 and fp32["top1_agreement"] >= 1 - 1 / (WINDOWS * (CTX - 1))
    # int4 weights: a real cost, far above the float noise of the fp32 export
    assert int4["kld_mean"] > 1e-3 and int4["kld_mean"] > 1000 * abs(fp32["kld_mean"])
    assert int4["top1_agreement"] < 1.0 and int4["ppl"] != ref["ppl"]
    # and the same again on a second run (fresh sessions): stable
    again = _eval(setup, [arts["int4"]])["results"][1]
    assert again["kld_mean"] == pytest.approx(int4["kld_mean"], rel=1e-6)
    assert again["ppl"] == pytest.approx(int4["ppl"], rel=1e-6)


def test_default_kv_export_sits_beside_its_pytorch_row(setup):
    """The exported default KV spec with fp32 weights against the same spec on the fp32 PyTorch model:
    close (same spec, same weights) but computed by onnxruntime in chunks."""
    d, arts = setup
    model, tok = load_model(str(d / "m"))
    ids = tok((d / "t.txt").read_text(), add_special_tokens=False)["input_ids"]
    res = evaluate_ids(model, ids, 32, ["default"], 1, model_name=str(d / "m"), progress=False,
                       extra_rows=[open_artifact(arts["small-pool"], model, str(d / "m"), 32)])
    ref, torch_row, onnx_row = res["results"]
    assert onnx_row["spec"] == "onnx fp32 / default" and onnx_row["kv_spec"] == "default"
    assert onnx_row["bytes_per_token_vs_fp16"] == torch_row["bytes_per_token_vs_fp16"] < 0.5
    assert torch_row["kld_mean"] > 0 and onnx_row["kld_mean"] > 0
    assert onnx_row["ppl"] == pytest.approx(torch_row["ppl"], rel=0.01)


def test_cli_table_and_json(setup):
    d, arts = setup
    base = ["eval", str(d / "m"), "--text", str(d / "t.txt"), "--ctx", str(CTX), "--windows", str(WINDOWS)]
    res = CliRunner().invoke(app, base + ["--artifacts", str(arts["fp32"]), "--artifacts", str(arts["int4"]), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # no --spec: the artifacts' own KV spec (fp32, the reference itself) beside them
    assert [r["spec"] for r in out["results"]] == ["fp32", "onnx fp32 / fp32", "onnx int4 / fp32"]
    # an artifacts dir as MODEL: the model its manifest names is the reference
    res = CliRunner().invoke(app, ["eval", str(arts["int4"]), "--text", str(d / "t.txt"), "--ctx", str(CTX),
                                   "--windows", str(WINDOWS), "--spec", "default"])
    assert res.exit_code == 0, res.output
    assert "onnx int4 / fp32" in res.stdout and "default" in res.stdout and "KLD" in res.stdout


def _one_line_exit_2(res, needle):
    text = " ".join(res.output.split())  # rich wraps long lines
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and needle in text, res.output


def test_hostile_artifacts_dirs(setup, tmp_path):
    d, arts = setup
    base = ["eval", str(d / "m"), "--text", str(d / "t.txt"), "--ctx", str(CTX), "--windows", str(WINDOWS)]
    run = lambda *extra: CliRunner().invoke(app, base + list(extra))  # noqa: E731

    _one_line_exit_2(run("--artifacts", str(tmp_path / "nope")), "is not a directory")
    _one_line_exit_2(run("--artifacts", str(tmp_path)), "an artifacts directory made by")  # no pagedkv.json
    # other weights of the same architecture: the weights' sha256 differs
    _one_line_exit_2(run("--artifacts", str(arts["other"])), "was exported from other weights than")
    # another architecture as the reference
    save_tiny_hf_dir(tmp_path / "qwen", "qwen3")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "qwen"), "--text", str(d / "t.txt"), "--ctx", str(CTX),
                                   "--artifacts", str(arts["fp32"])])
    _one_line_exit_2(res, "was exported from another model than")
    # a pool of 32 tokens cannot hold a window of 48
    _one_line_exit_2(run("--artifacts", str(arts["small-pool"])), "its pool holds 2 blocks of 16 tokens")
    # the ONNX export has no .pte for the executorch backend
    _one_line_exit_2(run("--artifacts", str(arts["fp32"]), "--backend", "executorch"), "has no pte artifact")
    _one_line_exit_2(run("--artifacts", str(arts["fp32"]), "--backend", "torch"), "unknown backend 'torch'")

    # an edited manifest (digest mismatch), and one rewritten without the weights' sha256 naming another model
    edited = tmp_path / "edited"
    shutil.copytree(arts["fp32"], edited)
    m = json.loads((edited / "pagedkv.json").read_text())
    (edited / "pagedkv.json").write_text(json.dumps(m))
    _one_line_exit_2(run("--artifacts", str(edited)), "was modified after export")
    del m["model"]["weights_sha256"]
    m["model"]["name"] = "some-other-model"
    write_manifest(edited, m)
    _one_line_exit_2(run("--artifacts", str(edited)), "records no weights sha256")
    # the same without the sha but naming the reference: accepted (an export made before the sha was recorded)
    m["model"]["name"] = str(d / "m")
    write_manifest(edited, m)
    assert read_manifest(edited)["model"]["name"] == str(d / "m")
    res = run("--artifacts", str(edited), "--windows", "1", "--json")
    assert res.exit_code == 0, res.output
    # a damaged model file: the manifest's sha256 of the artifact catches it
    with open(edited / "model.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    _one_line_exit_2(run("--artifacts", str(edited)), "is corrupted or was modified")


def test_open_artifact_api_errors(setup):
    d, arts = setup
    model, _ = load_model(str(d / "m"))
    with pytest.raises(ArtifactError, match="its pool holds"):
        open_artifact(arts["small-pool"], model, str(d / "m"), CTX)


def test_pte_export_on_executorch_equals_the_reference(setup):
    """The same on the .pte through the ExecuTorch runtime (prefill chunks of its max_tokens_per_call)."""
    d, arts = setup
    export_artifacts(str(d / "m"), d / "pte", ("pte",), "fp32", PoolRequest(pool_tokens=128, max_seqs=1),
                     max_tokens_per_call=32, accept_fidelity=True)
    model, tok = load_model(str(d / "m"))
    ids = tok((d / "t.txt").read_text(), add_special_tokens=False)["input_ids"]
    res = evaluate_ids(model, ids, CTX, [], WINDOWS, model_name=str(d / "m"), progress=False,
                       extra_rows=[open_artifact(d / "pte", model, str(d / "m"), CTX, backend="executorch")])
    ref, pte = res["results"]
    assert pte["spec"] == "pte fp32 / fp32" and pte["backend"] == "executorch"
    assert pte["ppl"] == pytest.approx(ref["ppl"], rel=2e-5)
    assert abs(pte["kld_mean"]) < 1e-6
    with pytest.raises(ArtifactError, match="has no onnx artifact for the onnxruntime backend"):
        open_artifact(d / "pte", model, str(d / "m"), CTX)
