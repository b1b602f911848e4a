"""Chat on top of the engine: chat template, incremental prefill of each turn, streamed text.

Each turn renders the whole conversation with the tokenizer's chat template and feeds only the
tokens the cache does not hold yet; the conversation's blocks stay in the pool between turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from runtime_sim.engine import Engine, Sampling
from toolkit.errors import PagedKVError, PoolExhausted


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

    # -- /save NAME, /load NAME (the file format: toolkit/CONVERSATION_FORMAT.md) --------------------

    def save(self, path) -> int:
        """Write the conversation's cache and its messages (the file's app bytes). Returns its size."""
        app = json.dumps({"system_prompt": self.system_prompt, "messages": self.messages}).encode()
        return self.engine.save(self.cid, path, app)

    def load(self, path) -> None:
        """Replace this chat with a saved one, its cache restored without prefill. On any error the
        current chat is kept as it was."""
        from runtime_sim import conversation_file as cf
        from toolkit.errors import PoolStateError

        d = cf.read(path)
        try:
            meta = json.loads(d.app.decode("utf-8"))
            messages = meta["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages):
                raise ValueError
        except (ValueError, TypeError, KeyError):
            raise cf.ConversationFileError(f"conversation file {path} holds no chat messages: it was not saved by "
                                           "`pagedkv chat` (/save NAME).") from None
        try:
            cid = self.engine.restore_data(d, path)
            self.engine.close(self.cid)
        except (PoolExhausted, PoolStateError):  # no room beside the current chat: swap it out, back on error
            old = self.engine.capture(self.cid)
            self.engine.close(self.cid)
            try:
                cid = self.engine.restore_data(d, path)
            except BaseException:
                self.cid = self.engine.restore_data(old, "(the current chat)")
                raise
        self.cid, self.messages, self.system_prompt = cid, messages, meta.get("system_prompt")

    def send(self, text: str, max_new_tokens: int = 128, sampling: Sampling | None = None) -> Iterator[str]:
        """Stream the reply to `text`. A turn that fails (pool exhausted, a template that rejects the
        conversation, ...) is rolled back: the message leaves the history and the cache holds nothing
        of it, so later turns are unaffected. A turn interrupted by Ctrl-C (KeyboardInterrupt) keeps
        the message and the reply so far."""
        conv = self.engine.conversations[self.cid]
        before = (list(conv.history), list(conv.pending), conv.seq)
        n_messages = len(self.messages)
        self.messages.append({"role": "user", "content": text})
        out: list[int] = []
        try:
            yield from self._turn(max_new_tokens, sampling, out)
        except KeyboardInterrupt:
            self._drop_cache_if_changed(before)
            reply = self.engine.tokenizer.decode(out, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
            raise
        except BaseException:
            del self.messages[n_messages:]
            self._drop_cache_if_changed(before)
            raise

    def _drop_cache_if_changed(self, before) -> None:
        """After a failed or interrupted turn the cache may hold part of it (or a step may have stopped
        half-way): release it; the next turn prefills the conversation again from its messages."""
        conv = self.engine.conversations[self.cid]
        if (conv.history, conv.pending, conv.seq) != before:
            self.engine.clear(self.cid)

    def _check_room_to_restart(self, n_tokens: int) -> None:
        """With the 'error' policy, refuse a restart that cannot fit before dropping the cache it would
        replace (so a failed turn leaves the pool as it was)."""
        if self.engine.policy != "error":
            return
        pool = self.engine.pool
        seq = self.engine.conversations[self.cid].seq
        have = pool.num_free_blocks + sum(b >= 0 for b in pool.block_table(seq))
        need = -(-n_tokens // pool.block_size)
        if need > have:
            raise PoolExhausted(need, have, f"the whole conversation ({n_tokens} tokens)")

    def _turn(self, max_new_tokens: int, sampling: Sampling | None, out: list[int]) -> Iterator[str]:
        ids = self._render()
        conv = self.engine.conversations[self.cid]
        held = conv.history + conv.pending
        if ids[: len(held)] != held:  # template re-rendered differently: start the cache over
            self._check_room_to_restart(len(ids))
            self.engine.clear(self.cid)
            held = []
        new = ids[len(held):]
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


def conversation_path(name: str) -> Path:
    """/save NAME and /load NAME: NAME is a file path; '.pkvc' is added when it has no suffix."""
    name = name.strip()
    if not name:
        raise PagedKVError("give a name: /save NAME or /load NAME (a file path; .pkvc is added).")
    p = Path(name).expanduser()
    return p if p.suffix else p.with_suffix(".pkvc")
