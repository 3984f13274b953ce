"""One session, two gateway replicas, one database: the scenario of `make compose-smoke`
(replicas in containers) and of tests/deploy/test_two_replicas.py (two `lethe serve` processes).

A replica keeps KV caches in its own memory only; the ledger, sessions, keys and the audit log live
in the shared database. So a session must survive a move between replicas, each replica's view of
the audit log must verify, and killing a replica must lose nothing it acknowledged. The steps:

1. replica 1 serves three tool results: a clean one (allowed), an injected web page (quarantined:
   never enters a cache) and a leaked key (per the shipped policy: forgotten right after the turn);
2. replica 2, which never saw the session, is sent the same request: it rebuilds the cache from
   the ledger, and its cache digest equals replica 1's;
3. the session continues on replica 2, and replica 1, sent the same history, agrees on the digest;
4. a forget through replica 2: the witness says max|Δ| = 0 on K, V and logits, the erasure proof
   verifies, and both replicas then hold what a session that never saw the segment holds;
5. `lethe audit verify --url` against each replica (replica 2 checked against the checkpoint read
   from replica 1 earlier: one log, not two) and `lethe audit verify --export`;
6. replica 1 is killed (SIGKILL) while it streams a reply, and restarted: every acknowledged
   ledger segment and audit record is still there, and the session goes on.

Each step yields a Check; the caller prints the table and fails if any check failed.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from gateway.demo import CONFIG_FILE, LEAKED_KEY, WEATHER, WEB_PAGE, _call

SECRET_ACTION = "redact"  # the shipped policy: the secret is cut out and only the redacted text enters


@dataclass
class Check:
    step: str
    ok: bool
    detail: str
    seconds: float = 0.0


class Replica(Protocol):
    name: str
    url: str

    def kill(self) -> None:
        """SIGKILL the replica's server process, without any chance to clean up."""

    def start(self) -> None:
        """Start it again; return once /readyz answers 200."""


@dataclass
class Keys:
    tenant: str  # a tenant admin key: chat, forget, erasure proofs
    admin: str  # the global admin key: the full audit export


def wait_ready(url: str, timeout_s: float = 2400.0, alive: Callable[[], bool] = lambda: True) -> float:
    """Poll GET /readyz until 200; returns the seconds waited. Fails fast if the server died."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not alive():
            raise RuntimeError(f"the gateway at {url} exited while starting; its log says why")
        try:
            response = httpx.get(url + "/readyz", timeout=2)
            if response.status_code == 200:
                return time.monotonic() - started
            if response.json().get("status") == "failed":
                raise RuntimeError(f"the gateway at {url} failed to load its model: {response.json()}")
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the gateway at {url} was not ready after {timeout_s:.0f} s")


def lethe_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`lethe ARGS` run the way a user runs it: a separate process of this Python."""
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@dataclass
class Scenario:
    r1: Replica
    r2: Replica
    keys: Keys
    export: Callable[[Path], None]  # writes a `lethe audit export` of the shared log to the path
    checks: list[Check] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    session: str = ""
    _last_request: list[dict[str, Any]] = field(default_factory=list)  # turn 3's request, as sent
    _pinned: Path | None = None  # the audit log's genesis public key (see _pinned_key)

    # ---- plumbing ---------------------------------------------------------------------------

    def _http(self, replica: Replica, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=replica.url, timeout=600,
                            headers={"Authorization": f"Bearer {key or self.keys.tenant}"})

    def _openai(self, replica: Replica) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=replica.url + "/v1", api_key=self.keys.tenant, max_retries=0, timeout=600)

    def _turn(self, replica: Replica, messages: list[dict[str, Any]], max_tokens: int) -> tuple[dict[str, Any], str]:
        """One acknowledged chat turn through the openai SDK: (the lethe extension, the reply)."""
        raw = self._openai(replica).chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0,
            extra_headers={"X-Lethe-Session": self.session} if self.session else None)
        self.session = raw.headers["x-lethe-session"]
        completion = raw.parse()
        return completion.model_extra["lethe"], completion.choices[0].message.content or ""

    def _inspect(self, replica: Replica, session: str | None = None) -> dict[str, Any]:
        with self._http(replica) as http:
            response = http.get(f"/v1/sessions/{session or self.session}")
        response.raise_for_status()
        return response.json()

    def _segments(self, replica: Replica) -> list[dict[str, Any]]:
        with self._http(replica) as http:
            response = http.get(f"/v1/sessions/{self.session}/segments")
        response.raise_for_status()
        return response.json()["segments"]

    def _digest_after(self, replica: Replica, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Send `messages` (nothing new to the session) and read the cache it leaves behind."""
        self._turn(replica, messages, max_tokens=1)
        return self._inspect(replica)

    def _check(self, step: str, fn: Callable[[], tuple[bool, str]]) -> bool:
        started = time.monotonic()
        try:
            ok, detail = fn()
        except Exception as exc:  # a step that raises is a failed check, and the table says why
            ok, detail = False, f"{exc.__class__.__name__}: {str(exc)[:300]}"
        self.checks.append(Check(step, ok, detail, time.monotonic() - started))
        return ok

    # ---- the steps --------------------------------------------------------------------------

    def run(self) -> list[Check]:
        if self._check("r1: clean, injected, secret tool results", self.tool_results):
            self._check("r2: session rebuilt from the ledger", self.rebuilt_on_r2)
            self._check("r2: session continues, r1 agrees", self.continued_on_r2)
            self._check("r2: forget = never saw, on both", self.forget_through_r2)
        trusted = self._trusted_checkpoint()
        self._check("audit verify --url r1", lambda: self.verify_url(self.r1))
        self._check("audit verify --url r2 (r1's checkpoint)", lambda: self.verify_url(self.r2, trusted))
        self._check("audit verify --export", self.verify_export)
        if self.session:
            self._check("r1 killed mid-turn, restarted: nothing lost", self.kill_mid_turn)
        return self.checks

    def tool_results(self) -> tuple[bool, str]:
        self.messages = [
            {"role": "system", "content": "You are a concise travel assistant."},
            {"role": "user", "content": "I'm in Paris tomorrow. Weather, tips, and check my deploy config."},
        ]
        script = [("get_weather", {"city": "Paris"}, WEATHER),
                  ("fetch_page", {"url": "https://travel.example/paris"}, WEB_PAGE),
                  ("read_file", {"path": "deploy/.env"}, CONFIG_FILE)]
        actions = []
        for n, (tool, args, result) in enumerate(script):
            self.messages += [_call(f"call_{n}", tool, args), {"role": "tool", "tool_call_id": f"call_{n}", "content": result}]
            lethe, reply = self._turn(self.r1, self.messages, max_tokens=4)
            actions.append(lethe["actions"][-1])
            if n < len(script) - 1:
                self.messages.append({"role": "assistant", "content": reply})
        self._last_request = list(self.messages)
        self.messages.append({"role": "assistant", "content": reply})
        states = {s["tool"]: s["state"] for s in self._segments(self.r1) if s.get("tool")}
        names = [a["action"] for a in actions]
        ok = (names == ["allow", "quarantine", SECRET_ACTION] and actions[1]["gate"]["injection"] >= 0.5
              and actions[2]["gate"]["secret"] >= 0.5 and states.get("fetch_page") == "quarantined"
              and states.get("read_file") == "live" and LEAKED_KEY not in json.dumps(actions))
        return ok, f"actions {names}; segment states {states}; session {self.session}"

    def rebuilt_on_r2(self) -> tuple[bool, str]:
        one = self._inspect(self.r1)
        before = self._inspect(self.r2)
        two = self._digest_after(self.r2, self._last_request)
        ok = not before["resident"] and one["cache_digest"] == two["cache_digest"] and one["tokens"] == two["tokens"]
        return ok, (f"r2 held {before['tokens']} tokens before; r1 {one['tokens']} tok {one['cache_digest'][:12]}, "
                    f"r2 {two['tokens']} tok {two['cache_digest'][:12]}")

    def continued_on_r2(self) -> tuple[bool, str]:
        self.messages.append({"role": "user", "content": "Thanks. Which museum should I see first?"})
        lethe, reply = self._turn(self.r2, self.messages, max_tokens=4)
        two = self._inspect(self.r2)
        one = self._digest_after(self.r1, self.messages)
        self.messages.append({"role": "assistant", "content": reply})
        ok = one["cache_digest"] == two["cache_digest"] and one["tokens"] == two["tokens"]
        return ok, f"{two['tokens']} tokens; r2 {two['cache_digest'][:12]}, r1 {one['cache_digest'][:12]}"

    def forget_through_r2(self) -> tuple[bool, str]:
        from audit.verify import verify_erasure_proof

        sha = hashlib.sha256(WEATHER.encode()).hexdigest()
        with self._http(self.r2) as http:
            response = http.post(f"/v1/sessions/{self.session}/forget", json={"content_sha256": sha})
            response.raise_for_status()
            forget = response.json()
            proof = http.get(f"/v1/audit/erasures/{forget['audit_indices'][0]}/proof")
            proof.raise_for_status()
        witness = forget["witness"]
        exact = witness["equal"] is True and witness["max_abs_dk"] == witness["max_abs_dv"] == witness["max_abs_dlogits"] == 0
        proof_ok = verify_erasure_proof(proof.json(), public_key_pem=self._pinned_key().read_text()).ok
        two = self._inspect(self.r2)  # the edited cache, no turn since
        stale = self._inspect(self.r1)  # r1 has not touched the session since: its resident cache is old
        known = self.messages[:-1]  # what the ledger holds: the last reply has not been sent back yet
        one = self._digest_after(self.r1, known)
        # a session that never saw the weather report: the same history without that tool result
        self.session, kept = "", self.session
        fresh = self._digest_after(self.r1, [m for m in known if m.get("content") != WEATHER])
        self.session = kept
        same = two["cache_digest"] == one["cache_digest"] == fresh["cache_digest"]
        ok = exact and proof_ok and same and two["tokens"] == one["tokens"] == fresh["tokens"]
        return ok, (f"witness max|Δ| K {witness['max_abs_dk']} V {witness['max_abs_dv']} logits "
                    f"{witness['max_abs_dlogits']}; proof {'ok' if proof_ok else 'FAILED'}; {two['tokens']} tokens "
                    f"r2 {two['cache_digest'][:12]}, r1 {one['tokens']} {one['cache_digest'][:12]}, never-saw "
                    f"{fresh['tokens']} {fresh['cache_digest'][:12]}; r1 before its next turn still held "
                    f"{stale['tokens']} tokens")

    def _trusted_checkpoint(self) -> Path | None:
        with self._http(self.r1, self.keys.admin) as http:
            response = http.get("/v1/audit/checkpoint")
        if response.status_code != 200:
            return None
        path = Path(tempfile.mkstemp(prefix="lethe-checkpoint-", suffix=".txt")[1])
        path.write_text(response.json()["note"])
        return path

    def _pinned_key(self) -> Path:
        """The log's genesis key, read once from replica 1 and pinned from then on (trust on first
        use, as an auditor would keep it): every later verification must chain from it."""
        if self._pinned is None:
            with self._http(self.r1, self.keys.admin) as http:
                response = http.get("/v1/audit/public-key")
                response.raise_for_status()
            self._pinned = Path(tempfile.mkstemp(prefix="lethe-audit-key-", suffix=".pem")[1])
            self._pinned.write_text(response.json()["keys"][0]["public_key_pem"])
        return self._pinned

    def verify_url(self, replica: Replica, trusted: Path | None = None) -> tuple[bool, str]:
        args = ["audit", "verify", "--url", replica.url, "--api-key", self.keys.admin,
                "--public-key", str(self._pinned_key())]
        if trusted is not None:
            args += ["--trusted-checkpoint", str(trusted)]
        done = lethe_cli(*args)
        return done.returncode == 0, _last_lines(done)

    def verify_export(self) -> tuple[bool, str]:
        with tempfile.TemporaryDirectory(prefix="lethe-export-") as tmp:
            path = Path(tmp) / "audit.json"
            self.export(path)
            text = path.read_text()
            leaked = LEAKED_KEY in text or "Ignore all previous" in text
            done = lethe_cli("audit", "verify", "--export", str(path), "--public-key", str(self._pinned_key()))
        return done.returncode == 0 and not leaked, f"{len(text)} bytes; " + (
            "TEXT LEAKED into the export; " if leaked else "") + _last_lines(done)

    def kill_mid_turn(self) -> tuple[bool, str]:
        before = self._segments(self.r1)
        with self._http(self.r1, self.keys.admin) as http:
            size_before = http.get("/v1/audit/checkpoint").json()["size"]
        stream = self._openai(self.r1).chat.completions.create(
            model="smollm2", messages=self.messages + [{"role": "user", "content": "Plan my whole day, hour by hour."}],
            max_tokens=200, temperature=0, stream=True, extra_headers={"X-Lethe-Session": self.session})
        chunks = 0
        try:
            for _ in stream:
                chunks += 1
                if chunks == 2:  # the reply is being generated: the turn is in flight
                    self.r1.kill()
        except Exception as exc:  # the connection drops with the server: expected
            cut = exc.__class__.__name__
        else:
            cut = "the stream ended normally (the kill came too late)"
        started = time.monotonic()
        self.r1.start()
        restart_s = time.monotonic() - started
        after = self._segments(self.r1)
        with self._http(self.r1, self.keys.admin) as http:
            size_after = http.get("/v1/audit/checkpoint").json()["size"]
        key = ("id", "role", "state", "n_tokens", "content_sha256")
        kept = [{k: s.get(k) for k in key} for s in after[:len(before)]] == [{k: s.get(k) for k in key} for s in before]
        two = self._digest_after(self.r2, self.messages)
        one = self._digest_after(self.r1, self.messages)
        ok = cut != "the stream ended normally (the kill came too late)" and kept and size_after >= size_before \
            and one["cache_digest"] == two["cache_digest"]
        return ok, (f"cut after {chunks} chunks ({cut}); restart {restart_s:.0f} s; segments {len(before)} -> "
                    f"{len(after)}, acknowledged kept: {kept}; audit size {size_before} -> {size_after}; "
                    f"then r1 {one['cache_digest'][:12]} = r2 {two['cache_digest'][:12]}")


def _last_lines(done: subprocess.CompletedProcess[str], n: int = 2) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return f"rc {done.returncode}: " + " | ".join(lines[-n:])[:300]


def table(checks: list[Check]) -> str:
    rows = [("", "step", "s", "detail")] + [("PASS" if c.ok else "FAIL", c.step, f"{c.seconds:.1f}", c.detail)
                                             for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]) for r in rows)


# ---- compose mode (deploy/compose-smoke.sh) -----------------------------------------------------

@dataclass
class ComposeReplica:
    """A gateway replica that is a docker-compose service."""

    name: str
    url: str
    compose: list[str]  # e.g. ["docker-compose", "-p", "lethe-smoke", "-f", ...]

    def kill(self) -> None:
        subprocess.run([*self.compose, "kill", "-s", "SIGKILL", self.name], check=True, capture_output=True)

    def start(self) -> None:
        subprocess.run([*self.compose, "start", self.name], check=True, capture_output=True)
        wait_ready(self.url)


def compose_export(compose: list[str], service: str) -> Callable[[Path], None]:
    def export(path: Path) -> None:
        out = "/tmp/lethe-audit-export.json"
        subprocess.run([*compose, "exec", "-T", service, "lethe", "audit", "export", "--out", out],
                       check=True, capture_output=True)
        done = subprocess.run([*compose, "exec", "-T", service, "cat", out], check=True, capture_output=True)
        path.write_bytes(done.stdout)
    return export


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the two-replica scenario against a running compose stack")
    parser.add_argument("--compose", required=True, help="the docker-compose command line, quoted")
    parser.add_argument("--url1", required=True)
    parser.add_argument("--url2", required=True)
    parser.add_argument("--tenant-key", required=True)
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--json", type=Path, help="also write the checks as JSON here")
    opts = parser.parse_args(argv)
    compose = opts.compose.split()
    scenario = Scenario(ComposeReplica("gateway-1", opts.url1, compose), ComposeReplica("gateway-2", opts.url2, compose),
                        Keys(opts.tenant_key, opts.admin_key), compose_export(compose, "gateway-2"))
    checks = scenario.run()
    print(table(checks), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps([c.__dict__ for c in checks], indent=1))
    return 0 if checks and all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
