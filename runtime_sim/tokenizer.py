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

from toolkit.errors import ArtifactError, PagedKVError


class ArtifactTokenizer:
    def __init__(self, art_dir: Path, names: list[str] | None = None):
        """`names`: the tokenizer files the manifest lists (only those are read)."""
        from tokenizers import Tokenizer

        art_dir = Path(art_dir)
        allowed = set(names) if names is not None else None

        def listed(name: str) -> Path | None:
            path = art_dir / name
            return path if path.is_file() and (allowed is None or name in allowed) else None

        path = listed("tokenizer.json")
        if path is None:
            raise ArtifactError(f"{art_dir / 'tokenizer.json'} is missing: re-export the model (the tokenizer is "
                                "saved with it).")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise ArtifactError(f"{path} is not a valid tokenizer ({str(e)[:120]}): re-run `pagedkv export`.") from None
        cfg_path = listed("tokenizer_config.json")
        self.config = {}
        if cfg_path is not None:
            try:
                self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise ArtifactError(f"{cfg_path} is not valid JSON ({e}): re-run `pagedkv export`.") from None
            if not isinstance(self.config, dict):
                raise ArtifactError(f"{cfg_path} is not a JSON object: re-run `pagedkv export`.")
        tmpl_path = listed("chat_template.jinja")
        try:
            self.chat_template = tmpl_path.read_text(encoding="utf-8") if tmpl_path else self.config.get("chat_template")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{tmpl_path} is not UTF-8 ({e}): re-run `pagedkv export`.") from None
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ArtifactError(f"the chat template in {art_dir} is not a string (a list of named templates is not "
                                "supported): re-export with one template.")
        self._template = None
        if self.chat_template:
            self._compile_template(str(tmpl_path or cfg_path))

    def _compile_template(self, where: str) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(self.chat_template)
        except TemplateError as e:
            raise ArtifactError(f"the chat template in {where} does not parse ({e}): fix it or re-export.") from None

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
        from jinja2.exceptions import TemplateError

        special = {k: self._special(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
        except TemplateError as e:  # e.g. a template that requires alternating user/assistant roles
            raise PagedKVError(f"the chat template rejected the conversation ({e}): /clear to start over.") from None
        except Exception as e:  # a template bug (undefined filter, type error) is the artifact's fault
            raise ArtifactError(f"the chat template fails ({type(e).__name__}: {e}): fix it or re-export.") from None
        if not tokenize:
            return text
        ids = self(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids} if return_dict else ids
