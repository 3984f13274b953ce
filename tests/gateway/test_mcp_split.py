"""A secret split across the text blocks of one MCP result is redacted in every block (issue 13).

The proxy scans a result's blocks as one document joined by newlines, which end any token: a key
cut over two blocks would pass as two harmless pieces. The blocks are also scanned glued, so each
block's fragment is cut. In process, with the fixture upstream as a real process (as in
test_mcp_faults.py)."""
from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from mcp import Client

from audit import AuditLog, Signer
from gate import Gate
from gateway.mcp import Caller, Guard, McpSettings, Proxy, UpstreamSpec
from gateway.tenants import Principal
from ledger import Ledger
from policies import PolicyEngine

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from mcp_upstream import CREDENTIALS  # noqa: E402

KEY_ID, SECRET = "AKIAPTGZ6JFEBZSDOXRL", "nHBdHIyvNLVlRXFwF8JlMaLNy02K35uDNHfkf7J8"


def _acme() -> Caller:
    """The agent, in an MCP session of its own each time (no case reads another's text: history.py)."""
    return Caller(Principal("acme", "agent"), None, uuid.uuid4().hex)


def _serves(caller: Caller) -> Callable[[object], Caller]:
    return lambda _ctx: caller


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Proxy:
    tmp = tmp_path_factory.mktemp("mcp-split")
    url = f"sqlite:///{tmp / 'lethe.db'}"
    ledger = Ledger(url)
    settings = McpSettings(upstreams=[UpstreamSpec(name="fx", command=[sys.executable, str(HERE / "mcp_upstream.py")])],
                           call_timeout_s=10)
    guard = Guard(Gate(), PolicyEngine(), ledger, AuditLog(url, Signer.load_or_create(tmp / "key.pem")),
                  settings.max_result_bytes)
    return Proxy(settings, guard, ledger)


def _pieces(proxy: Proxy, cuts: list[int]) -> list[str]:
    async def go() -> list[str]:
        async with proxy.running(), Client(proxy.server(_serves(_acme()))) as client:
            result = await client.call_tool("fx__credentials_in_pieces", {"cuts": cuts})
        return [block.text for block in result.content]
    return anyio.run(go)


def _at(where: str, offset: int) -> int:
    return CREDENTIALS.index(KEY_ID if where == "kid" else SECRET) + offset


@pytest.mark.parametrize("cuts", [
    [("kid", 10)], [("sec", 20)], [("kid", 10), ("sec", 20)], [("kid", 3), ("kid", 12)], [("sec", 6), ("sec", 27)],
], ids=["key-id", "secret", "both", "key-id-twice", "secret-twice"])
def test_every_block_holding_a_fragment_of_a_split_secret_is_redacted(proxy: Proxy, cuts) -> None:
    blocks = _pieces(proxy, [_at(*c) for c in cuts])
    assert len(blocks) == len(cuts) + 1
    shown = "\n".join(blocks)
    fragments = {s[i:i + 3] for s in (KEY_ID, SECRET) for i in range(len(s) - 2)}
    assert "[REDACTED:aws_access_key_id]" in shown and "[REDACTED:aws_secret_access_key]" in shown
    assert not [f for f in fragments if f in shown.replace("[REDACTED:aws_access_key_id]", "")
                .replace("[REDACTED:aws_secret_access_key]", "")]
    assert "region = eu-west-1" in shown  # the rest of the result is still there


def _call(proxy: Proxy, name: str, arguments: dict[str, object]) -> tuple[bool, str]:
    async def go() -> tuple[bool, str]:
        async with proxy.running(), Client(proxy.server(_serves(_acme()))) as client:
            result = await client.call_tool(name, arguments)
        return result.is_error, "\n".join(getattr(b, "text", "") for b in result.content)
    return anyio.run(go)


@pytest.mark.parametrize("arguments", [
    {"text": "aws_access_key_id = AKIAPTGZ6J", "more": "FEBZSDOXRL"},
    {"text": ["note: AKIAPTGZ6J", "FEBZSDOXRL"]},
    {"a": "AKIAPTGZ6J", "b": "FEBZSDOXRL", "text": "hi"},
    {"text": "hi", "a": "AKIAPTGZ6J", "b": ["FEBZSDOXRL"]},
    {"more": "FEBZSDOXRL", "text": "AKIAPTGZ6J"},  # red team 13: the halves in the other order
    {"AKIAPTGZ6J": "FEBZSDOXRL"},  # a key and its value
    {"a": "AKIAPTGZ6J", "FEBZSDOXRL": 1},  # a value and the next key
    {"parts": ["AKIA", "PTGZ6J", "FEBZ", "SDOXRL"]},  # red team 14: over four values, each pair harmless
    {"a": "AKIAP", "b": "TGZ6JFE", "c": "BZSDOXRL", "text": "hi"},
], ids=["two-values", "list", "neighbour-after", "neighbour-before-and-a-list", "other-order", "key-and-value",
        "value-and-key", "four-values", "three-values"])
def test_a_key_split_over_argument_values_is_refused_before_the_upstream(proxy: Proxy, arguments) -> None:
    """Red team: the halves of an AWS key id in two argument values passed (each value is a JSON
    part `"key": "value"`, and glued as such the quotes broke the key); each seam between two
    values is now read as the raw strings on either side, whatever the other values hold."""
    refused, text = _call(proxy, "fx__echo", arguments)
    assert refused and "refused by policy" in text and "AKIA" not in text, text


@pytest.mark.parametrize("arguments", [
    {"text": "FEBZSDOXRL then AKIAPTGZ6J"},  # one value: no seam
    {"text": "AKIAPTGZ6J", "more": "hello"},  # a seam, but no key across it
], ids=["one-value", "no-key-across"])
def test_argument_values_that_do_not_join_into_a_key_go_ahead(proxy: Proxy, arguments) -> None:
    refused, text = _call(proxy, "fx__echo", arguments)
    assert not refused and text == arguments["text"]


def test_a_key_split_over_json_values_is_found_and_its_parts_are_cut_whole() -> None:
    from gateway.mcp.guard import Document
    doc = Document.of_arguments({"note": "x", "a": "AKIAPTGZ6J", "b": ["FEBZSDOXRL"], "c": "after"})
    found = {(f.byte_start, f.byte_end) for f in doc.glued_secrets(Gate())}
    first, last = doc.spans[1], doc.spans[3]  # `"a": "AKIAPTGZ6J"`, then `"b"`, then `"FEBZSDOXRL"`
    # each JSON string holding a fragment, whole (escapes move offsets); a key beside it is kept
    assert found == {(first[0] + len('"a": '), first[1]), last}


def test_a_key_split_over_four_values_is_cut_from_each_and_its_neighbours_are_kept() -> None:
    from gateway.mcp.guard import Document
    doc = Document.of_arguments({"note": "hello", "p": ["AKIA", "PTGZ6J", "FEBZ", "SDOXRL"], "after": "bye"})
    found = {(f.byte_start, f.byte_end) for f in doc.glued_secrets(Gate())}
    pieces = {doc.data[s:e] for s, e in found}
    assert all(any(p in piece for piece in pieces) for p in (b"AKIA", b"PTGZ6J", b"FEBZ", b"SDOXRL"))
    assert not any(b"hello" in piece or b"bye" in piece for piece in pieces)
