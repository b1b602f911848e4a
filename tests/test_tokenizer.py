"""runtime_sim's tokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer on
the same saved files, and the onnxruntime path staying free of torch."""

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runtime_sim.tokenizer import ArtifactTokenizer
from toolkit.errors import ArtifactError
from toolkit.tiny_models import tiny_bpe_tokenizer

REPO = Path(__file__).resolve().parents[1]

# exercises a default system turn, loop variables, the special-token variables and the generation prompt
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|system|>\nYou are helpful.{{ eos_token }}\n{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? \u00e9\U0001f642"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3+3?\n"}],
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, wikitext):
    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:2000]
    tok = tiny_bpe_tokenizer(lines)
    tok.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    return d


def test_matches_transformers(saved):
    ours, hf = ArtifactTokenizer(saved), AutoTokenizer.from_pretrained(saved)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = list(hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False))
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == want
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == hf.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=False)
    text = "The tower is 324 m tall \u2014 caf\u00e9 \U0001f642"
    for special in (True, False):
        assert ours(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
    ids = ours.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_missing_files_and_template(tmp_path, saved):
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        ArtifactTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    with pytest.raises(ArtifactError, match="no chat template"):
        ArtifactTokenizer(tmp_path).apply_chat_template(CONVERSATIONS[0])


def test_onnxruntime_path_does_not_import_torch(saved):
    code = ("import sys; from runtime_sim.session import open_artifacts; from runtime_sim.backends import OrtBackend; "
            f"from runtime_sim.tokenizer import ArtifactTokenizer; ArtifactTokenizer({str(saved)!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
