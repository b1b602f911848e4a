"""Calibration at export (toolkit/calibration.py, toolkit/key_offsets.py): key offsets that let low-bit keys
hold on a model whose keys carry large per-channel offsets (a tiny Qwen2 with a planted k_proj bias), the
fidelity guard, and hostile calibration data in an artifacts dir."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from export.artifacts import PoolRequest, export_artifacts
from toolkit.calibration import KEY_OFFSETS_FILE, read_key_offsets
from toolkit.errors import ArtifactError, SpecError
from toolkit.fidelity import evaluate_ids
from toolkit.key_offsets import measure_key_offsets
from toolkit.manifest import DIGEST_NAME, MANIFEST_NAME, read_manifest, sha256_bytes
from toolkit.tiny_models import plant_key_outliers, tiny_model

IDS = [(i * 7919 + 13) % 512 for i in range(512)]


def outlier_model():
    return plant_key_outliers(tiny_model("qwen2"))


def test_offsets_are_the_planted_bias_and_exact_for_attention():
    """The measured offset sits on the planted channels, and subtracting it leaves attention unchanged: the op
    on a float32 pool gives the same output for k and k - offset (the softmax ignores a shift common to all keys)."""
    model = outlier_model()
    offsets = measure_key_offsets(model, IDS[:128])
    assert len(offsets) == 2 and offsets[0].shape == (2, 64)
    big = offsets[0].abs() > 20
    assert big[:, [30, 31, 62, 63]].any() and not big[:, :30].any()

    from toolkit.pool_layout import PoolLayout
    from toolkit.quant import PRESETS

    torch.manual_seed(0)
    t, hq, hkv, d = 20, 4, 2, 64
    q, k, v = torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d) * 3, torch.randn(1, hkv, t, d)
    outs = []
    for kk in (k, k - offsets[0][None, :, None, :]):
        codes, scales, stage = PoolLayout(PRESETS["fp32"], 1, hkv, d, 16, 4, 1).allocate_layer()
        out = torch.ops.pagedkv.quantized_paged_attention(
            q, kk, v, codes, scales, stage, torch.arange(t), torch.zeros(t, dtype=torch.int64),
            torch.arange(4)[None], torch.full((hq,), float("-inf")), 0, 32, 32, 64, 64, True, True, False, False, 0,
            d ** -0.5, 0, 0.0)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_low_bit_keys_collapse_without_offsets_and_hold_with_them():
    """k4v4 on the outlier model: the plain pool loses the keys (KLD ~0.7, top-1 ~18%); with the offsets the
    same spec stays close to the unquantized pool (KLD ~0.045). Measured on the native core, as export does."""
    model = outlier_model()
    offsets = measure_key_offsets(model, IDS[-256:])
    plain = evaluate_ids(model, IDS, 256, ["k4v4"], 1, progress=False)["results"][1]
    held = evaluate_ids(model, IDS, 256, ["k4v4"], 1, progress=False, key_offsets=offsets)["results"][1]
    assert plain["kld_mean"] > 10 * held["kld_mean"] and held["top1_agreement"] > plain["top1_agreement"] + 0.3


def _export(out, spec, **kw):
    return export_artifacts("tiny-qwen2-outliers", out, ("onnx",), spec, PoolRequest(pool_tokens=128, max_seqs=1),
                            model_and_tokenizer=(outlier_model(), None), **kw)


def test_guard_refuses_a_spec_that_fails_and_names_one_that_passes(tmp_path):
    with pytest.raises(SpecError) as e:
        _export(tmp_path / "a", "k4v4")
    msg = str(e.value)
    assert "\n" not in msg and "pool spec K4s/g32 V4s/g32" in msg and "over the bound 0.02" in msg
    assert "--spec default measures" in msg and "--accept-fidelity" in msg
    assert not (tmp_path / "a").exists()
    m = _export(tmp_path / "b", "k4v4", accept_fidelity=True)
    cal = m["calibration"]
    assert cal["accepted_below_bound"] is True and cal["fidelity"]["pool"]["kld"] > 0.02


def test_export_records_calibration_and_the_offsets_file(tmp_path):
    m = _export(tmp_path / "a", "default")
    cal = m["calibration"]
    assert cal["tokens"] == 512 and cal["max_kld"] == 0.02 and "accepted_below_bound" not in cal
    assert 0 < cal["fidelity"]["pool"]["kld"] <= 0.02 and cal["key_offsets"]["shape"] == [2, 2, 64]
    got = read_key_offsets(tmp_path / "a", m)
    want = measure_key_offsets(outlier_model(), IDS)  # no tokenizer: the fixed id sequence
    for a, b in zip(got, want):
        assert torch.equal(a, b.float())
    # a float pool stores keys as they are: nothing calibrated, no file
    m = _export(tmp_path / "f", "fp32")
    assert "calibration" not in m and not (tmp_path / "f" / KEY_OFFSETS_FILE).exists()


def _rewrite_manifest(d, change):
    m = json.loads((d / MANIFEST_NAME).read_text())
    change(m)
    data = (json.dumps(m, indent=2) + "\n").encode()
    (d / MANIFEST_NAME).write_bytes(data)
    (d / DIGEST_NAME).write_text(f"{sha256_bytes(data)}  {MANIFEST_NAME}\n")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "art"
    _export(d, "default")
    return d


@pytest.mark.parametrize("edit,needle", [
    (lambda d: (d / KEY_OFFSETS_FILE).write_bytes((d / KEY_OFFSETS_FILE).read_bytes()[:-4]), "corrupted or was modified"),
    (lambda d: (d / KEY_OFFSETS_FILE).unlink(), "is missing"),
    (lambda d: _rewrite_manifest(d, lambda m: m["calibration"]["key_offsets"].update(shape=[2, 2, 32])),
     r"shape \[2, 2, 32\] does not match the model's \[2, 2, 64\]"),
    (lambda d: _rewrite_manifest(d, lambda m: m["calibration"]["key_offsets"].update(file="../x")), "file"),
    (lambda d: _rewrite_manifest(d, lambda m: m["calibration"].update(max_kld=-1)), "max_kld must be a positive"),
    (lambda d: _rewrite_manifest(d, lambda m: m["calibration"]["fidelity"]["pool"].update(kld="low")),
     "fidelity.pool must hold"),
])
def test_hostile_calibration_data_is_refused(calibrated, tmp_path, edit, needle):
    d = tmp_path / "art"
    shutil.copytree(calibrated, d)
    edit(d)
    with pytest.raises(ArtifactError, match=needle) as e:
        read_key_offsets(d, read_manifest(d))
    assert "\n" not in str(e.value)


def test_nan_offsets_with_a_matching_sha_are_refused(calibrated, tmp_path):
    """NaN written into the file and its sha256 updated to match: still refused (the values are checked)."""
    from toolkit.manifest import sha256_file

    d = tmp_path / "art"
    shutil.copytree(calibrated, d)
    data = np.fromfile(d / KEY_OFFSETS_FILE, dtype="<f4")
    data[5] = np.nan
    data.tofile(d / KEY_OFFSETS_FILE)
    _rewrite_manifest(d, lambda m: m["calibration"]["key_offsets"].update(sha256=sha256_file(d / KEY_OFFSETS_FILE)))
    with pytest.raises(ArtifactError, match="NaN or Inf key offsets"):
        read_key_offsets(d, read_manifest(d))


def test_cli_export_options_are_checked_first(tmp_path):
    """Bad --max-kld / --calib-text: one line, exit 2, before the model loads, no --out left behind."""
    for args, needle in ((["--max-kld", "-1"], "--max-kld -1"), (["--max-kld", "nan"], "--max-kld nan"),
                         (["--calib-text", str(tmp_path / "none.txt")], "does not exist")):
        out = tmp_path / "out"
        proc = subprocess.run([sys.executable, "-m", "toolkit.cli", "export", "smollm2", "--out", str(out), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_compact_role_is_scored_with_the_older_half_compacted():
    """The compact region's fidelity: the pool with its older half re-quantized to the compact spec sits between
    the pool all in the default spec and the pool all in the compact spec (scored on the same text)."""
    from toolkit.calibration import _reference, _score, _score_compact
    from toolkit.kv_spec import PRESETS, compact_spec_for

    model = outlier_model()
    offsets = measure_key_offsets(model, IDS[:256])
    spec = PRESETS["default"]
    compact = compact_spec_for(spec, 64)
    ids = IDS[:256]
    ref_logp, _ = _reference(model, ids)
    plain, _ = _score(model, ids, spec, offsets, ref_logp)
    half, _ = _score_compact(model, ids, spec, compact, offsets, ref_logp)
    every, _ = _score(model, ids, compact, offsets, ref_logp)
    assert plain < half < every


def test_bad_calibration_text_is_one_line_and_writes_nothing(tmp_path, wikitext):
    """A --calib-text too short to calibrate on, or not UTF-8: one line naming it, before anything is written."""
    from toolkit.errors import PagedKVError
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:500]
    tok = tiny_bpe_tokenizer(lines)
    short, binary = tmp_path / "short.txt", tmp_path / "binary.txt"
    short.write_text("a few words only")
    binary.write_bytes(b"\xff\xfe\x00bad")
    for path, needle in ((short, "fewer than 32"), (binary, "cannot read it as UTF-8")):
        out = tmp_path / f"out-{path.stem}"
        with pytest.raises(PagedKVError, match=needle) as e:
            export_artifacts("tiny-qwen2", out, ("onnx",), "default", PoolRequest(pool_tokens=64, max_seqs=1),
                             model_and_tokenizer=(tiny_model("qwen2"), tok), calib_text=path)
        assert "\n" not in str(e.value) and not out.exists() and not list(tmp_path.glob(".out-*"))
