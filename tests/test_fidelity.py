"""Fidelity evaluation (PPL / KLD / top-1 vs the fp32 pool) on a tiny llama, and the `eval` CLI."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tests.test_model_loading import WORDS, save_tiny_hf_dir
from toolkit.cli import app
from toolkit.errors import PagedKVError, SpecError
from toolkit.fidelity import evaluate_ids, parse_spec
from toolkit.quant import PRESETS
from toolkit.tiny_models import tiny_model

KEYS = {"spec", "bytes_per_token_vs_fp16", "ppl", "ppl_increase_pct", "kld_mean", "top1_agreement"}


SPECS = ["fp16", "default", "q8_0-q4_0", "default:v_group=16,sink_blocks=0"]


def eval_ids() -> torch.Tensor:
    """The token ids the `result` rows are evaluated on (2 windows of 48, and 5 more)"""
    torch.manual_seed(0)
    return torch.randint(3, 512, (2 * 48 + 5,))


@pytest.fixture(scope="module")
def result():
    return evaluate_ids(tiny_model("llama"), eval_ids(), ctx=48, specs=SPECS, windows=2, model_name="tiny",
                        progress=False)


def test_native_kernel_gives_the_reference_numbers(result):
    """`pagedkv eval` runs the op on the C++ core (kernel="native", the default): the same numbers as
    the plain-PyTorch reference, on the same windows and specs: PPL to 1e-4 (relative), KLD to 1%.
    The two quantize K/V with their own float arithmetic (C++ against torch's matmuls, whose rounding
    depends on the CPU), so a value on a rounding boundary can get another code: on an AMD EPYC that
    moved the default row's KLD by 0.17% (every native ISA path agreed with each other). A wrong
    spec, group or bit width moves it by far more: the quantized rows' KLDs differ by at least 3x."""
    ids = eval_ids()
    ref = evaluate_ids(tiny_model("llama"), ids, ctx=48, specs=SPECS, windows=2, model_name="tiny", progress=False,
                       kernel="reference")
    for want, got in zip(ref["results"], result["results"]):
        assert want["spec"] == got["spec"]
        assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-4)
        assert got["kld_mean"] == pytest.approx(want["kld_mean"], rel=1e-2, abs=1e-7)
        assert abs(got["top1_agreement"] - want["top1_agreement"]) <= 1 / 94  # at most one flipped argmax
    klds = sorted(r["kld_mean"] for r in ref["results"] if r["spec"] not in ("fp32", "fp16"))
    assert all(b > 3 * a for a, b in zip(klds, klds[1:]))  # the 1% above tells the specs apart
    with pytest.raises(PagedKVError, match="kernel='fast'"):
        evaluate_ids(tiny_model("llama"), ids, ctx=48, specs=SPECS, windows=1, progress=False, kernel="fast")


def test_shape(result):
    assert set(result) == {"model", "ctx", "bos", "results"} and result["bos"] is False
    assert result["model"] == "tiny" and result["ctx"] == 48
    assert [r["spec"] for r in result["results"]] == [
        "fp32", "fp16", "default", "q8_0-q4_0", "default:v_group=16,sink_blocks=0",
    ]
    for r in result["results"]:
        assert set(r) == KEYS
        assert all(math.isfinite(r[k]) for k in KEYS - {"spec"})
    json.dumps(result)


def test_reference_and_float_rows(result):
    fp32, fp16 = result["results"][:2]
    assert fp32["kld_mean"] == 0.0 and fp32["top1_agreement"] == 1.0 and fp32["ppl_increase_pct"] == 0.0
    assert fp32["bytes_per_token_vs_fp16"] == 2.0 and fp16["bytes_per_token_vs_fp16"] == 1.0
    assert 0.0 <= fp16["kld_mean"] < 1e-5
    assert fp16["top1_agreement"] >= 0.99
    assert abs(fp16["ppl_increase_pct"]) < 0.01


def test_quantized_rows(result):
    rows = {r["spec"]: r for r in result["results"]}
    for name in ("default", "q8_0-q4_0", "default:v_group=16,sink_blocks=0"):
        assert rows[name]["kld_mean"] > 0
        assert rows[name]["bytes_per_token_vs_fp16"] < 0.5
    # the tuned default beats the naive llama.cpp-style layout even on a random model
    assert rows["default"]["kld_mean"] < rows["q8_0-q4_0"]["kld_mean"]
    assert rows["default"]["bytes_per_token_vs_fp16"] == pytest.approx(0.4141, abs=1e-4)


def test_parse_spec():
    assert parse_spec("default") == ("default", PRESETS["default"])
    name, spec = parse_spec("default:v_group=16, v_sym=true,sink_blocks=0")
    assert spec == PRESETS["default"].replace(v_group=16, v_sym=True, sink_blocks=0)
    with pytest.raises(SpecError, match="FIELD=VALUE"):
        parse_spec("default:nope=1")
    with pytest.raises(SpecError, match="unknown KV spec"):
        parse_spec("k9v9")


def test_errors():
    model = tiny_model("llama")
    with pytest.raises(PagedKVError, match="fewer than 2 window"):
        evaluate_ids(model, list(range(3, 50)), ctx=32, specs=["default"], windows=2, progress=False)
    with pytest.raises(SpecError, match="does not divide head_dim"):
        evaluate_ids(model, list(range(3, 50)), ctx=32, specs=["default:v_group=48"], windows=1, progress=False)


def test_cli_json(tmp_path):
    save_tiny_hf_dir(tmp_path / "m")
    gen = torch.Generator().manual_seed(1)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (200,), generator=gen)]
    (tmp_path / "t.txt").write_text(" ".join(words))
    args = ["eval", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--ctx", "32", "--windows", "2",
            "--spec", "fp16", "--spec", "k4v4", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # stdout holds the JSON object and nothing else
    assert out["ctx"] == 32 and [r["spec"] for r in out["results"]] == ["fp32", "fp16", "k4v4"]
    assert out["results"][2]["kld_mean"] > 0

    res = CliRunner().invoke(app, args[:-1])  # the table
    assert res.exit_code == 0 and "k4v4" in res.stdout and "KLD" in res.stdout


def test_cli_errors(tmp_path):
    (tmp_path / "t.txt").write_text("w1 w2")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "missing"), "--text", str(tmp_path / "t.txt"), "--ctx", "8"])
    assert res.exit_code == 2 and "does not exist" in " ".join(res.output.split())  # rich wraps lines
    res = CliRunner().invoke(app, ["eval", "smollm2", "--text", str(tmp_path / "nope.txt"), "--ctx", "8"])
    assert res.exit_code == 2 and "does not exist: pass --text" in " ".join(res.output.split())


def test_bos_replaces_each_windows_first_token():
    torch.manual_seed(0)
    ids = torch.randint(3, 512, (2 * 32,))
    model = tiny_model("llama")
    run = lambda x, bos: evaluate_ids(model, x, ctx=32, specs=["k4v4"], windows=2, progress=False, bos_id=bos)
    with_bos, without = run(ids, 1), run(ids, None)
    assert with_bos["bos"] and with_bos["results"] != without["results"]
    ids[0] = ids[32] = 1  # windows that already start with BOS: the same numbers either way
    assert run(ids, 1)["results"] == run(ids, None)["results"]


def test_rows_scored_in_chunks_equal_the_whole(monkeypatch):
    """_score_rows scores ROWS_PER_CHUNK logits rows at a time (a 262k vocabulary's temporaries at ctx 4096
    would take 4 GiB each): the sums equal the whole window's within float64 summation order."""
    from toolkit import fidelity

    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(37, 50, generator=g) * 3, torch.randn(37, 50, generator=g) * 3
    target = torch.randint(0, 50, (37,), generator=g)
    ref_logp = torch.log_softmax(ref, -1)
    logp = torch.log_softmax(logits, -1)
    want = (float(-logp.gather(1, target[:, None]).sum(dtype=torch.float64)),
            float((ref_logp.exp() * (ref_logp - logp)).sum(dtype=torch.float64)),
            float((logp.argmax(-1) == ref_logp.argmax(-1)).sum()))
    monkeypatch.setattr(fidelity, "ROWS_PER_CHUNK", 5)  # 8 chunks, the last of 2 rows
    got = fidelity._score_rows(logits, target, ref_logp)
    assert got[2] == want[2] and want[1] > 0
    assert got[0] == pytest.approx(want[0], rel=1e-9) and got[1] == pytest.approx(want[1], rel=1e-9)
