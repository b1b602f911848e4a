"""pagedkv.json carries the chat template and the stop ids (eos + the template's end-of-turn token) for
runners that do not read the tokenizer files (the Android runner reads `chat_template` and
`stop_token_ids`; tests/test_android_app.py runs it on a manifest with both), plus the sha256 of the
exported weights; the manifest reader refuses malformed values with one line."""

import copy
import json

import pytest

from export.artifacts import PoolRequest, chat_fields, export_artifacts
from tests.test_model_loading import tiny_tokenizer
from toolkit.errors import ArtifactError
from toolkit.manifest import MAX_CHAT_TEMPLATE_BYTES, read_manifest, validate_manifest, weights_sha256
from toolkit.tiny_models import tiny_model

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_tokenizer():
    """The tiny word-level tokenizer (eos </s> = 2) with ChatML turns: <|im_end|> ends a turn but is
    not the eos token, as in many instruct models."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "art"
    tok = chatml_tokenizer()
    export_artifacts("tiny-llama", out, ("onnx",), "fp32", PoolRequest(pool_tokens=64, max_seqs=1),
                     model_and_tokenizer=(tiny_model("llama"), tok), accept_fidelity=True)
    return out, tok


def test_export_writes_template_stop_ids_and_weights_sha(exported):
    out, tok = exported
    m = read_manifest(out)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn not in (tok.eos_token_id, None) and end_of_turn < m["model"]["vocab_size"]
    assert m["chat_template"] == CHATML
    assert m["stop_token_ids"] == sorted({tok.eos_token_id, end_of_turn})
    assert m["model"]["eos_token_ids"] == [tok.eos_token_id]  # eos stays the model's own
    # the weights the export was made from (a fresh model with the same seed has the same sha256)
    assert m["model"]["weights_sha256"] == weights_sha256(tiny_model("llama"))
    assert weights_sha256(tiny_model("llama", seed=1)) != m["model"]["weights_sha256"]


def test_chat_fields_without_a_template_or_tokenizer():
    assert chat_fields(None, [2], 512) == {}
    assert chat_fields(tiny_tokenizer(), [2], 512) == {"stop_token_ids": [2]}
    # ids the model cannot produce (beyond its vocab) are left out
    assert chat_fields(chatml_tokenizer(), [2], 505) == {"chat_template": CHATML, "stop_token_ids": [2]}
    # a template that refuses the probe chat names no end of turn (and the export goes on)
    tok = chatml_tokenizer()
    tok.chat_template = "{{ raise_exception('no assistant turns here') }}"
    assert chat_fields(tok, [2], 512)["stop_token_ids"] == [2]


BAD = [
    ({"chat_template": 5}, "chat_template must be a non-empty string"),
    ({"chat_template": ""}, "chat_template must be a non-empty string"),
    ({"chat_template": "x" * (MAX_CHAT_TEMPLATE_BYTES + 1)}, "more than the"),
    ({"chat_template": "a\ud800b"}, "lone surrogate"),
    ({"stop_token_ids": "2"}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [512]}, "not below model.vocab_size=512"),
    ({"stop_token_ids": list(range(65))}, "more than 64"),
]


@pytest.mark.parametrize("change,needle", BAD, ids=[b[1][:30] + str(i) for i, b in enumerate(BAD)])
def test_malformed_chat_fields_are_one_line(exported, change, needle):
    out, _ = exported
    m = copy.deepcopy(json.loads((out / "pagedkv.json").read_text()))
    m.update(change)
    with pytest.raises(ArtifactError, match="re-run `pagedkv export`") as e:
        validate_manifest(m)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_malformed_weights_sha(exported):
    out, _ = exported
    m = json.loads((out / "pagedkv.json").read_text())
    for bad in ("abc", 5, "g" * 64):
        m["model"]["weights_sha256"] = bad
        with pytest.raises(ArtifactError, match="model.weights_sha256 must be 64 hex digits"):
            validate_manifest(m)
    del m["model"]["weights_sha256"]  # optional: manifests written before it was recorded still read
    validate_manifest(m)


def test_desktop_chat_stops_at_the_manifests_end_of_turn(exported):
    """runtime_sim stops generating at the chat's end-of-turn token, not only at eos (as the runner does)."""
    from runtime_sim.session import open_artifacts

    out, tok = exported
    engine = open_artifacts(out, "onnxruntime")
    assert tok.convert_tokens_to_ids("<|im_end|>") in engine.stop_ids
    assert tok.eos_token_id in engine.stop_ids
