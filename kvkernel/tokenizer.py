"""A byte-level tokenizer for the tiny random test model: no files, no downloads, fully reversible."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ByteTokenizer:
    """Token ids 0..255 are raw UTF-8 bytes; 256 is BOS and 257 is EOS.

    It mirrors the slice of the Hugging Face tokenizer API the kernel and its tests use
    (``encode``, ``decode``, ``apply_chat_template``) so a tiny model can stand in for the real one.
    """

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                parts.append("<s>" if i == self.bos_token_id else "</s>")
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tokenize: bool = True, add_generation_prompt: bool = False, **_: Any) -> list[int] | str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text
