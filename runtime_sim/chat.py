"""Chat on top of the engine: chat template, incremental prefill of each turn, streamed text.

Each turn renders the whole conversation with the tokenizer's chat template and feeds only the
tokens the cache does not hold yet; the conversation's blocks stay in the pool between turns.
"""

from __future__ import annotations

from typing import Iterator

from runtime_sim.engine import Engine, Sampling
from toolkit.errors import PagedKVError


class ChatSession:
    def __init__(self, engine: Engine, system_prompt: str | None = None):
        if engine.tokenizer is None:
            raise PagedKVError("these artifacts have no tokenizer files: re-export from a model with a tokenizer.")
        self.engine = engine
        self.system_prompt = system_prompt
        self.cid = engine.new_conversation()
        self.messages: list[dict] = []
        self._reset_messages()

    def _reset_messages(self):
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _render(self) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant:"
        return tok(text, add_special_tokens=False)["input_ids"]

    def clear(self) -> None:
        """Forget the conversation; its blocks return to the pool at once."""
        self.engine.clear(self.cid)
        self._reset_messages()

    def send(self, text: str, max_new_tokens: int = 128, sampling: Sampling | None = None) -> Iterator[str]:
        self.messages.append({"role": "user", "content": text})
        ids = self._render()
        conv = self.engine.conversations[self.cid]
        held = conv.history + conv.pending
        if ids[: len(held)] != held:  # template re-rendered differently: start the cache over
            self.engine.clear(self.cid)
            held = []
        new = ids[len(held):]
        out: list[int] = []
        shown = ""
        tok = self.engine.tokenizer
        for t in self.engine.generate(self.cid, new, max_new_tokens, sampling, self.engine.stop_ids):
            if t in self.engine.stop_ids:
                break
            out.append(t)
            text_now = tok.decode(out, skip_special_tokens=True)
            if len(text_now) > len(shown) and not text_now.endswith("\ufffd"):
                yield text_now[len(shown):]
                shown = text_now
        reply = tok.decode(out, skip_special_tokens=True)
        if len(reply) > len(shown):
            yield reply[len(shown):]
        self.messages.append({"role": "assistant", "content": reply})
