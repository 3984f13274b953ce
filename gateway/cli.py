"""`lethe`: serve the gateway, manage tenants and keys, run benchmarks, test policies, verify audits."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from . import __version__
from .config import Settings
from .logging import configure_logging

app = typer.Typer(help="Lethe: a security and governance gateway for LLM agents.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenants.", no_args_is_help=True)
key_app = typer.Typer(help="API keys (stored hashed; shown once).", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks; readable by default, one JSON object with --json.", no_args_is_help=True)
gate_app = typer.Typer(help="The byte-gate.", no_args_is_help=True)
policy_app = typer.Typer(help="Rego policies.", no_args_is_help=True)
audit_app = typer.Typer(help="The signed audit log.", no_args_is_help=True)
kernel_app = typer.Typer(help="The exact KV kernel.", no_args_is_help=True)
for sub, name in ((tenant_app, "tenant"), (key_app, "key"), (bench_app, "bench"), (gate_app, "gate"),
                  (policy_app, "policy"), (audit_app, "audit"), (kernel_app, "kernel")):
    app.add_typer(sub, name=name)


def _settings() -> Settings:
    settings = Settings()
    configure_logging(settings.log_level, settings.log_json)
    return settings


def _emit(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


JsonFlag = Annotated[bool, typer.Option("--json", help="print one JSON object (for scripts and CI)")]


def _report(obj: dict[str, Any], json_out: bool) -> None:
    """A benchmark's result: one JSON object with --json, else one ``dotted.key: value`` per line."""
    if json_out:
        typer.echo(json.dumps(obj, sort_keys=True, default=str))
        return
    for key, value in _flatten(obj):
        typer.echo(f"{key}: {value}")


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict) and obj:
        return [item for k, v in obj.items() for item in _flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), obj)]


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(f"lethe {__version__}")


@app.command()
def prepare() -> None:
    """Convert the configured model once into the local safetensors cache (shows progress)."""
    from kvkernel import prepare_model

    s = _settings()
    path = prepare_model(s.model, cache_dir=s.resolved("model_cache_dir", "models"), progress=True)
    typer.echo(f"model ready at {path}")


@app.command()
def serve(host: Annotated[Optional[str], typer.Option()] = None,
          port: Annotated[Optional[int], typer.Option()] = None) -> None:
    """Serve the gateway (the model loads in the background; /readyz turns 200 when it is in)."""
    import uvicorn

    from .app import create_app
    from .wiring import server_config

    s = _settings()
    uvicorn.Server(server_config(create_app(s), s, host or s.host, port or s.port)).run()


@app.command()
def mcp(upstream: Annotated[Optional[list[str]], typer.Option(
            help="NAME=COMMAND ARGS... (stdio) or NAME=https://host/mcp; repeat for several")] = None,
        tenant: Annotated[Optional[str], typer.Option(help="stdio: the tenant this process speaks for")] = None,
        user: Annotated[Optional[str], typer.Option(help="stdio: the user, for the records")] = None,
        session: Annotated[Optional[str], typer.Option(help="stdio: the chat session to link results to")] = None,
        http: Annotated[bool, typer.Option(help="serve streamable HTTP at /mcp (API keys) instead of stdio")] = False,
        host: Annotated[Optional[str], typer.Option()] = None,
        port: Annotated[Optional[int], typer.Option(help="HTTP port (default LETHE_MCP_PORT)")] = None) -> None:
    """MCP proxy: every tool call's arguments and result screened by gate and policy, recorded, audited."""
    from .mcp.run import run_http, run_stdio

    s = _settings()
    if http:
        run_http(s, upstream or [], host or s.host, port or s.mcp_port)
    elif tenant is None:
        raise typer.BadParameter("stdio needs --tenant (the tenant this process speaks for); or pass --http")
    else:
        run_stdio(s, upstream or [], tenant, user, session)


# ---- tenants and keys -----------------------------------------------------------------------

def _tenants():  # type: ignore[no-untyped-def]
    from .tenants import TenantStore

    s = _settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    return TenantStore.from_url(s.db_url)


@tenant_app.command("create")
def tenant_create(name: str) -> None:
    """Create a tenant."""
    _tenants().create_tenant(name)
    typer.echo(f"tenant {name} created")


@tenant_app.command("list")
def tenant_list() -> None:
    """List tenants."""
    for name in _tenants().tenants():
        typer.echo(name)


@key_app.command("create")
def key_create(tenant: Annotated[Optional[str], typer.Option(help="the key's tenant")] = None,
               user: Annotated[Optional[str], typer.Option(help="the user the key acts for")] = None,
               role: Annotated[Optional[list[str]], typer.Option(help="roles, e.g. compliance")] = None,
               admin: Annotated[bool, typer.Option(help="tenant admin, or global admin without --tenant")] = False
               ) -> None:
    """Create an API key and print it once."""
    typer.echo(_tenants().create_key(tenant, user=user, roles=tuple(role or ()), admin=admin))


# ---- the kernel -----------------------------------------------------------------------------

PlanOption = Annotated[Optional[str], typer.Option(
    "--plan", help="force a plan by name ('xeon', 'amd', 'fallback-m<M>'); default: LETHE_KERNEL_PLAN, else calibrate")]


def _model_and_settings():  # type: ignore[no-untyped-def]
    from kvkernel import load_model

    s = _settings()
    return s, load_model(s.model, cache_dir=s.resolved("model_cache_dir", "models"), device=s.device, dtype=s.dtype)


@kernel_app.command("plan")
def kernel_plan(plan: PlanOption = None, json_out: JsonFlag = False) -> None:
    """The canonical plan for this machine and model: cached and re-verified, or calibrated now."""
    from kvkernel import named_plan

    from .wiring import kernel_for

    if plan:
        named_plan(plan)  # refuse an unknown name before loading the model
    s, model = _model_and_settings()
    if plan:
        s = s.model_copy(update={"kernel_plan": plan})
    kernel = kernel_for(s, model)
    _report({"model": model.name, **kernel.provenance(), **kernel.calibration.to_dict()}, json_out)
    kernel.close()


# ---- benchmarks -----------------------------------------------------------------------------

@bench_app.command("kernel")
def bench_kernel(context: int = 2000, span: int = 300, decode_tokens: int = 32, plan: PlanOption = None,
                 json_out: JsonFlag = False) -> None:
    """Exact kernel vs plain transformers on the real model: prefill, decode, forget, amortize, witness."""
    from kvkernel import named_plan
    from kvkernel.bench import run_kernel_bench

    name = plan or Settings().kernel_plan
    forced = named_plan(name) if name else None  # refuse an unknown name before loading the model
    s, model = _model_and_settings()
    _report(run_kernel_bench(model, context=context, span=span, decode_tokens=decode_tokens,
                             plan=forced, plan_dir=s.data_dir / "kernel-plans"), json_out)


@bench_app.command("gate")
def bench_gate(megabytes: int = 10, json_out: JsonFlag = False) -> None:
    """Rules-layer MB/s, learned-layer throughput, p50/p99 latency at 4 KB and 64 KB."""
    from gate.bench import run_gate_bench

    _report(run_gate_bench(megabytes=megabytes), json_out)


@bench_app.command("mcp")
def bench_mcp(clients: int = 8, calls: int = 50, json_out: JsonFlag = False) -> None:
    """MCP proxy overhead per tool call beyond the gate's scan: p50/p99 over concurrent clients."""
    from .mcp.bench import run_mcp_bench

    _settings()  # logs to stderr at the configured level: stdout carries only the result
    _report(run_mcp_bench(clients=clients, calls=calls), json_out)


@bench_app.command("memory")
def bench_memory(sessions: int = 200, turns: int = 3, rows: Annotated[int, typer.Option(help="lines per tool result")] = 4,
                 max_tokens: int = 2, concurrency: int = 8, budget_share: Annotated[float, typer.Option(
                     help="the KV budget as a share of what the sessions need")] = 0.1,
                 sample: Annotated[int, typer.Option(help="offloaded sessions compared with a fresh prefill")] = 16,
                 long_tokens: Annotated[int, typer.Option(help="the restore-vs-rebuild session's tokens")] = 2000,
                 reps: int = 3, json_out: JsonFlag = False) -> None:
    """KV budget under load: status codes, peak RSS vs budget + overhead, ledgers, exact restores,
    restore vs rebuild. Progress on stderr; the gateway listens on LETHE_PORT."""
    from .membench import run_memory_bench

    settings = _settings()  # logs to stderr: stdout carries only the result
    _report(run_memory_bench(settings.model_copy(update={"log_level": "warning"}), sessions=sessions, turns=turns,
                             rows=rows, max_tokens=max_tokens, concurrency=concurrency, budget_share=budget_share,
                             sample=sample, long_tokens=long_tokens, reps=reps), json_out)


@bench_app.command("policy")
def bench_policy(iterations: int = 5000, opa_url: Annotated[Optional[str], typer.Option()] = None,
                 json_out: JsonFlag = False) -> None:
    """p50/p99 decision latency, embedded engine (and an OPA server when --opa-url answers)."""
    from policies.bench import run_policy_bench

    _report(run_policy_bench(iterations=iterations, opa_url=opa_url), json_out)


@bench_app.command("audit")
def bench_audit(records: int = 1_000_000, postgres_url: Annotated[Optional[str], typer.Option()] = None,
                sqlite_path: Annotated[Optional[Path], typer.Option()] = None,
                verify_records: Annotated[int, typer.Option(help="records in the offline verification run (0: skip)")] = 100_000,
                json_out: JsonFlag = False) -> None:
    """Appends/s on SQLite (and PostgreSQL), proofs at 10^6 records, offline verification of 10^5."""
    from audit.bench import run_audit_bench

    _settings()  # logs to stderr at the configured level: stdout carries only the result
    _report(run_audit_bench(sqlite_path=sqlite_path, postgres_url=postgres_url, records=records,
                            verify_records=verify_records), json_out)


@bench_app.command("gateway")
def bench_gateway(sessions: int = 8, turns: int = 20, json_out: JsonFlag = False) -> None:
    """A bounded load run on loopback; gateway overhead per tool result, model compute excluded."""
    from .demo import local_gateway
    from .loadtest import run_load

    with local_gateway(_settings()) as gw:
        result = run_load(gw.base, gw.key, sessions=sessions, turns=turns)
        result["audit_verified"] = _verify_live_audit(gw.app.state.lethe.audit)
    _report(result, json_out)


def _verify_live_audit(log: Any) -> bool:
    """The run's log verifies, anchored to its genesis key (read from this process's own database)."""
    import tempfile

    from audit.verify import verify_export

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "export.json"
        log.checkpoint()
        log.export(path)
        return bool(verify_export(path, public_key_pem=log.keys()[0]["public_key_pem"]).ok)


# ---- gate -----------------------------------------------------------------------------------

@gate_app.command("scan")
def gate_scan(path: Path) -> None:
    """Scan a file as a tool result and print the report (secret values are masked)."""

    _emit(_settings().gate().scan(path.read_bytes()).to_dict())


@gate_app.command("eval")
def gate_eval(data: Annotated[Path, typer.Option(help="JSONL of {text, label}")],
              probe: Annotated[bool, typer.Option(help="score injection as the gateway does: the byte gate stacked "
                                                       "with the hidden-state probe (runs the model)")] = False,
              json_out: JsonFlag = False) -> None:
    """Precision, recall, FPR, recall at 1% FPR, ROC AUC and throughput per label."""
    import time

    from gate.evaluate import load_rows, report, scan_rows

    s = _settings()
    rows = load_rows(data)
    model_dir = None
    if probe:  # the probe reads the configured model's states: convert it first, as `lethe prepare` does
        from kvkernel import prepare_model

        model_dir = prepare_model(s.model, cache_dir=s.resolved("model_cache_dir", "models"), progress=True)
    started = time.perf_counter()
    scores, nbytes = scan_rows(rows, s.gate())
    cached = False
    if probe:
        from gate import InjectionProbe
        from gate.train.eval_full import stack_scores

        _, scores["injection"], cached = stack_scores(rows, scores["injection"], name=data.stem, model_dir=model_dir,
                                                      probe=InjectionProbe.load(s.probe_path),  # LETHE_PROBE_PATH
                                                      threads=1)  # 2 threads thrash on a shared 2-core machine
    thresholds = _policy_thresholds(s)
    result = report(data, rows, scores, nbytes, time.perf_counter() - started, thresholds=thresholds)
    if all("kind" in r for r in rows):  # a held-out-by-kind set (python -m gate.train.kinds): per-kind figures
        import numpy as np

        from gate.train.kind_eval import summary

        y = np.array([r["label"] == "injection" for r in rows], dtype=float)
        result["injection"]["held_out_by_kind"] = summary(rows, scores["injection"], y, thresholds["injection"])
    result["injection_scorer"] = "stack(probe, byte gate)" if probe else "byte gate"
    if cached:
        result["note"] = "the probe read cached model states (var/probe_features/): throughput excludes the model pass"
    if json_out:
        _emit(result)
        return
    for label in ("injection", "secret"):
        typer.echo(f"{label:10} " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in result[label].items() if not isinstance(v, dict)))
        at = result[label].get("at_policy_threshold")
        if at:
            typer.echo(f"{'':10} at the policy's threshold {at['threshold']}: recall={at['recall']:.4f} "
                       f"fpr={at['fpr']:.4f} precision={at['precision']:.4f}")
    typer.echo(f"{result['documents']} documents, {result['megabytes']} MB, {result['throughput_mb_s']} MB/s; "
               f"injection scored by the {result['injection_scorer']}")


def _policy_thresholds(s) -> dict[str, float]:
    """The default tenant's gate thresholds from the configured policy bundle's data."""
    from policies.bundle import load_bundle

    data = json.loads(load_bundle(s.policy_dir).data_json)
    return {k: float(v) for k, v in data["lethe"]["defaults"]["thresholds"].items() if k in ("injection", "secret")}


# ---- policy ---------------------------------------------------------------------------------

@policy_app.command("test")
def policy_test(directory: Annotated[Optional[Path], typer.Argument()] = None) -> None:
    """Run every *_test.rego (rules named test_*) on the embedded engine, like `opa test`."""
    from policies import run_rego_tests

    report = run_rego_tests(directory)
    typer.echo(report.format())
    raise typer.Exit(0 if report.ok else 1)


@policy_app.command("eval")
def policy_eval(rule: Annotated[str, typer.Option(help="decision | tenancy | retention | erasure, or a path")],
                input_file: Annotated[Path, typer.Option("--input", help="input JSON file")]) -> None:
    """Evaluate one rule on an input and print the result."""
    from policies import PolicyEngine

    s = _settings()
    engine = PolicyEngine(s.policy_dir, backend=s.policy_backend, opa_url=s.opa_url, timeout_s=s.opa_timeout_s,
                          retries=s.opa_retries)
    path = rule if "/" in rule else f"lethe/{rule}"
    _emit(engine.evaluate(path, json.loads(input_file.read_text())))


# ---- audit ----------------------------------------------------------------------------------

@audit_app.command("export")
def audit_export(out: Annotated[Path, typer.Option(help="where to write the export")]) -> None:
    """Write a self-contained export of the audit log for offline verification."""
    from audit import AuditLog

    from .wiring import open_signer

    s = _settings()
    log = AuditLog(s.audit_db_url, open_signer(s), origin=s.audit_origin)
    log.checkpoint()
    log.export(out)
    typer.echo(f"exported {log.size} records to {out}")


@audit_app.command("verify")
def audit_verify(export: Annotated[Optional[Path], typer.Option(help="an export file")] = None,
                 url: Annotated[Optional[str], typer.Option(help="a gateway URL to fetch the export from")] = None,
                 proof: Annotated[Optional[Path], typer.Option(help="an erasure proof file")] = None,
                 api_key: Annotated[Optional[str], typer.Option(envvar="LETHE_API_KEY")] = None,
                 public_key: Annotated[Optional[Path], typer.Option(
                     help="the log's genesis public key PEM, or the signer of --trusted-checkpoint")] = None,
                 trusted_checkpoint: Annotated[Optional[Path], typer.Option(help="a checkpoint note you saved earlier")] = None,
                 no_anchor: Annotated[bool, typer.Option(
                     "--no-anchor", help="accept an export with no root of trust (internal consistency only)")] = False,
                 ) -> None:
    """Verify offline against a root of trust (--public-key and/or --trusted-checkpoint).

    Checks signatures, the tree, every inclusion, consistency with the trusted checkpoint, the key
    chain and every witness. Exit codes: 0 verified, 1 a check failed, 2 malformed input.
    """
    from audit.verify import run

    if sum(x is not None for x in (export, url, proof)) != 1:
        raise typer.BadParameter("give exactly one of --export FILE, --url URL or --proof FILE")
    if url is not None and not api_key:
        raise typer.BadParameter("--url needs --api-key (an admin key) or LETHE_API_KEY")
    raise typer.Exit(run(export=export, url=url, proof=proof, api_key=api_key, public_key=public_key,
                         trusted_checkpoint=trusted_checkpoint, no_anchor=no_anchor))


@app.command()
def demo(url: Annotated[Optional[str], typer.Option(help="use a running gateway instead of starting one")] = None,
         api_key: Annotated[Optional[str], typer.Option(envvar="LETHE_API_KEY")] = None) -> None:
    """Drive a scripted agent through the gateway with the official openai SDK, and print what happened."""
    from .demo import run_demo

    ok = run_demo(_settings(), url=url, api_key=api_key, out=sys.stdout)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()
