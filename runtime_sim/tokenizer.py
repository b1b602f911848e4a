"""The tokenizer saved next to exported artifacts, without transformers (so without torch).

`tokenizer.json` runs through the `tokenizers` library; the chat template (`chat_template.jinja`, or
`chat_template` in `tokenizer_config.json`) is rendered with jinja2 the way transformers renders it
(sandboxed, trim_blocks / lstrip_blocks, the special tokens as variables) and the text is then
encoded without adding special tokens. It offers what runtime_sim's chat needs: `chat_template`,
`apply_chat_template`, calling it on a text, and `decode`.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import ArtifactError


class ArtifactTokenizer:
    def __init__(self, art_dir: Path):
        from tokenizers import Tokenizer

        art_dir = Path(art_dir)
        path = art_dir / "tokenizer.json"
        if not path.is_file():
            raise ArtifactError(f"{path} is missing: re-export the model (the tokenizer is saved with it).")
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = art_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        tmpl_path = art_dir / "chat_template.jinja"
        self.chat_template = tmpl_path.read_text() if tmpl_path.is_file() else self.config.get("chat_template")
        self._template = None

    def _special(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False):
        if not self.chat_template:
            raise ArtifactError("these artifacts have no chat template.")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        special = {k: self._special(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
        if not tokenize:
            return text
        ids = self(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids} if return_dict else ids
