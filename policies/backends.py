"""The two places a Rego query can run: in process (regorus) or on an OPA server (REST Data API).

Why regorus (`gordon-to-regorus`, Rust) is the embedded engine, by evidence gathered for issue 5:

* It runs the project's Rego tests: every `policies/*_test.rego` passes on it (`run_rego_tests`).
* It agrees with real OPA on them: `opa-golib-python-bindings` 0.4.4 embeds OPA v1.20.2's own Go
  evaluator; its metadata says Python >= 3.14 but its wrapper is plain ctypes and runs on 3.11
  when installed with `--ignore-requires-python`. `tests/policies/test_conformance.py` runs every
  Rego test and a corpus of inputs for all four documents on both engines and asserts identical
  results. While writing the policies this comparison caught one real divergence,
  `not f(input.missing)` (true in regorus, undefined in OPA), which the policies now avoid with
  `object.get`; OPA also rejects at compile time a data key that collides with a rule, where
  regorus only fails at evaluation, so bundles are smoke-evaluated before activation.
* It is fast enough: on its compiled Rego VM a full `decide()` takes well under the 200 µs
  target (see `policies.bench`); its tree-walking interpreter took about 300 µs on `decision`.
* It installs cleanly from PyPI for this project's Python (3.11 to 3.13); the OPA bindings would
  need an install-time override of their declared Python range and load a Go runtime into the
  gateway process, so they serve as the conformance oracle and not as the default engine.
* Its limits: no `crypto.*` builtins (the policies need none; salts are HMACed in Python), and its
  `Engine` is a pyo3 `unsendable` class: touching one from a thread other than its creator's
  panics, cloning included. The embedded backend therefore never shares an engine: each thread
  builds its own from the immutable `Bundle` the first time it evaluates that bundle.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import regorus
import requests
import structlog
from opa_client import OpaClient

from policies.bundle import Bundle
from policies.model import PolicyError

log = structlog.get_logger(__name__)

_BUNDLES_PER_THREAD = 4  # bundles a thread keeps compiled: the active one plus recent reloads
# The documents the gateway queries; each must be defined by every bundle.
ENTRY_POINTS = ("data.lethe.decision", "data.lethe.tenancy", "data.lethe.retention", "data.lethe.erasure",
                "data.lethe.kv_priority")
_RVM_UNDEFINED = '"<undefined>"'  # what Rvm.execute_entry_point returns for an undefined document


class Backend(Protocol):
    name: str

    def evaluate(self, rule_path: str, input: Any) -> Any:
        """The value of data.<rule_path> for `input`, None when undefined; raises PolicyError."""


def rule_ref(rule_path: str) -> str:
    """"lethe/decision" -> "data.lethe.decision", refusing anything that is not a plain path."""
    parts = rule_path.strip("/").split("/")
    if not all(part.isidentifier() for part in parts):
        raise PolicyError(f"rule path {rule_path!r} must look like 'lethe/decision'")
    return "data." + ".".join(parts)


def engine_error(exc: BaseException) -> str:
    """regorus errors carry a Rust backtrace; keep the message, one line, bounded."""
    text = str(exc).split("Stack backtrace:")[0]
    return " ".join(text.split())[:500] or type(exc).__name__


def compile_bundle(bundle: Bundle) -> regorus.Engine:
    """A fresh regorus engine holding the bundle, owned by the calling thread."""
    engine = regorus.Engine()
    try:
        for rel, source in bundle.modules:
            engine.add_policy(rel, source)
        for _, text in bundle.data:
            engine.add_data_json(text)
    except Exception as exc:
        raise PolicyError(f"Rego or data does not load: {engine_error(exc)}") from exc
    return engine


def dumps_input(input: Any) -> str:
    try:
        return json.dumps(input, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy input is not JSON: {exc}") from exc


@dataclass
class _Compiled:
    """One thread's compiled copy of one bundle."""

    vm: regorus.Rvm
    interpreter: regorus.Engine | None = None


class EmbeddedBackend:
    """regorus in process; thread-safe because nothing compiled ever leaves the thread that built it.

    The four documents the gateway asks for (ENTRY_POINTS) run on regorus' compiled Rego VM
    (`Program` + `Rvm`): about 5x faster than its tree-walking interpreter on `decision`. Any
    other rule path (operators' ad-hoc `evaluate` calls) runs on the interpreter, built lazily,
    which also re-checks any undefined answer of the VM (rare: the policies define all four
    documents for every well-formed input), so errors are reported by name.
    """

    name = "embedded"
    _local = threading.local()

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle

    def evaluate(self, rule_path: str, input: Any) -> Any:
        ref = rule_ref(rule_path)
        payload = dumps_input(input)
        compiled = self._thread_compiled()
        try:
            if ref in ENTRY_POINTS:
                compiled.vm.set_input_json(payload)
                out = compiled.vm.execute_entry_point(ref)
                if out != _RVM_UNDEFINED:
                    return json.loads(out)
                # The VM reports evaluation errors (conflicting rules, failing builtins) as
                # undefined; the interpreter names them, and answers if the VM was wrong.
                result = self._interpret(compiled, ref, payload)
                if result is not None:
                    log.warning("policy.rvm_undefined_interpreter_defined", rule=ref, bundle_hash=self.bundle.hash)
                return result
            return self._interpret(compiled, ref, payload)
        except PolicyError:
            raise
        except BaseException as exc:  # pyo3 panics derive from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise PolicyError(f"engine error evaluating {ref}: {engine_error(exc)}") from exc

    def _interpret(self, compiled: _Compiled, ref: str, payload: str) -> Any:
        if compiled.interpreter is None:
            compiled.interpreter = compile_bundle(self.bundle)
        compiled.interpreter.set_input_json(payload)
        return compiled.interpreter.eval_rule(ref)

    def _thread_compiled(self) -> _Compiled:
        # Keyed by content hash: two bundles with equal bytes compile alike. Old entries are
        # evicted here, on their own thread, which is the only place pyo3 lets them drop.
        cache: OrderedDict[str, _Compiled] | None = getattr(self._local, "compiled", None)
        if cache is None:
            cache = self._local.compiled = OrderedDict()
        compiled = cache.get(self.bundle.hash)
        if compiled is None:
            compiled = cache[self.bundle.hash] = compile_vm(self.bundle)
            while len(cache) > _BUNDLES_PER_THREAD:
                cache.popitem(last=False)
        else:
            cache.move_to_end(self.bundle.hash)
        return compiled


def compile_vm(bundle: Bundle) -> _Compiled:
    try:
        program = regorus.Program.compile_from_modules(bundle.data_json, list(bundle.modules), list(ENTRY_POINTS))
        vm = regorus.Rvm()
        vm.load_program(program)
        vm.set_data_json(bundle.data_json)
    except Exception as exc:
        raise PolicyError(f"Rego does not compile: {engine_error(exc)}") from exc
    return _Compiled(vm)


class OpaBackend:
    """An OPA server's Data API (`POST /v1/data/<path>` with `{"input": ...}`) via opa-python-client.

    `timeout_s` bounds each HTTP attempt; `retries` goes to the client's urllib3 retry policy,
    which retries connections that fail before the request is sent (refused, reset). urllib3
    never retries a POST after it was sent, so a slow or failing OPA costs one timeout and the
    decision fails closed at once instead of stalling the request. Each thread gets its own
    client, so no `requests.Session` is shared across threads.
    """

    name = "opa"

    def __init__(self, opa_url: str, timeout_s: float, retries: int) -> None:
        parts = urlsplit(opa_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"opa_url {opa_url!r} must look like http://127.0.0.1:8181 (scheme, host, port; no path)")
        self.url = opa_url
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 8181)
        self._ssl = parts.scheme == "https"
        self.timeout_s = timeout_s
        self.retries = retries
        self._local = threading.local()

    def evaluate(self, rule_path: str, input: Any) -> Any:
        ref = rule_ref(rule_path)
        dumps_input(input)  # same refusal of non-JSON input as the embedded backend
        path = ref.removeprefix("data.").replace(".", "/")
        try:
            body = self._client().query_rule(input_data=input, package_path=path)
        except requests.Timeout as exc:
            raise PolicyError(f"opa at {self.url} timed out after {self.timeout_s}s evaluating {ref}") from exc
        except requests.ConnectionError as exc:
            raise PolicyError(f"opa at {self.url} is unreachable; start the opa service or fix opa_url") from exc
        except requests.HTTPError as exc:
            answer = exc.response
            status = "with no response" if answer is None else f"HTTP {answer.status_code}: {_opa_message(answer)}"
            raise PolicyError(f"opa at {self.url} answered {status}") from exc
        except (requests.RequestException, ValueError) as exc:
            raise PolicyError(f"opa at {self.url} failed evaluating {ref}: {exc}") from exc
        if not isinstance(body, dict):
            raise PolicyError(f"opa at {self.url} returned a non-object body for {ref}")
        return body.get("result")  # OPA omits "result" when the document is undefined

    def _client(self) -> OpaClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = OpaClient(
                host=self._host, port=self._port, ssl=self._ssl, timeout=self.timeout_s, retries=self.retries
            )
        return client


def _opa_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    return str(body.get("message", body))[:300] if isinstance(body, dict) else str(body)[:300]
