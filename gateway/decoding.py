"""Token ids to text, incrementally, for streaming: hold back what may still become a stop string
or an unfinished UTF-8 character, and cut the text at the first stop string."""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class TextStream:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tok = tokenizer
        self._stops = [s for s in stops if s]
        self._ids: list[int] = []
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        full = self._tok.decode(self._ids, skip_special_tokens=True)
        cut = min((full.find(s) for s in self._stops if s in full), default=-1)
        if cut >= 0:
            self.stopped = True
            return full[:cut]
        return full

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self.text
        if self.stopped:
            return self._emit(text)
        safe = len(text.rstrip("\ufffd"))
        for stop in self._stops:  # keep back a tail that is a prefix of a stop string
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:n]):
                    safe -= n
                    break
        return self._emit(text[:safe])

    def flush(self) -> str:
        return self._emit(self.text)

    def _emit(self, upto: str) -> str:
        piece = upto[self._emitted:]
        self._emitted = max(self._emitted, len(upto))
        return piece


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split `<tool_call>{"name", "arguments"}</tool_call>` blocks out of a reply (OpenAI shape)."""
    calls: list[dict[str, Any]] = []
    for block in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(block)
            name = str(payload["name"])
        except (ValueError, KeyError, TypeError):
            continue
        arguments = payload.get("arguments", {})
        calls.append({"id": "call_" + secrets.token_hex(8), "type": "function",
                      "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments)}})
    return (_TOOL_CALL.sub("", text).strip() if calls else text), calls
