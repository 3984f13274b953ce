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
for sub, name in ((tenant_app, "tenant"), (key_app, "key"), (bench_app, "bench"), (gate_app, "gate"),
                  (policy_app, "policy"), (audit_app, "audit")):
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

    s = _settings()
    uvicorn.run(create_app(s), host=host or s.host, port=port or s.port, log_config=None, access_log=False,
                timeout_graceful_shutdown=int(s.shutdown_grace_s) + 1)


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


# ---- benchmarks -----------------------------------------------------------------------------

@bench_app.command("kernel")
def bench_kernel(context: int = 2000, span: int = 300, decode_tokens: int = 32, json_out: JsonFlag = False) -> None:
    """Exact kernel vs plain transformers on the real model: prefill, decode, forget, amortize, witness."""
    from kvkernel import load_model
    from kvkernel.bench import run_kernel_bench

    s = _settings()
    model = load_model(s.model, cache_dir=s.resolved("model_cache_dir", "models"), device=s.device, dtype=s.dtype)
    _report(run_kernel_bench(model, context=context, span=span, decode_tokens=decode_tokens), json_out)


@bench_app.command("gate")
def bench_gate(megabytes: int = 10, json_out: JsonFlag = False) -> None:
    """Rules-layer MB/s, learned-layer throughput, p50/p99 latency at 4 KB and 64 KB."""
    from gate.bench import run_gate_bench

    _report(run_gate_bench(megabytes=megabytes), json_out)


@bench_app.command("policy")
def bench_policy(iterations: int = 5000, opa_url: Annotated[Optional[str], typer.Option()] = None,
                 json_out: JsonFlag = False) -> None:
    """p50/p99 decision latency, embedded engine (and an OPA server when --opa-url answers)."""
    from policies.bench import run_policy_bench

    _report(run_policy_bench(iterations=iterations, opa_url=opa_url), json_out)


@bench_app.command("audit")
def bench_audit(records: int = 1_000_000, postgres_url: Annotated[Optional[str], typer.Option()] = None,
                sqlite_path: Annotated[Optional[Path], typer.Option()] = None, json_out: JsonFlag = False) -> None:
    """Appends/s on SQLite (and PostgreSQL), proof generation + verification at 10^6 records."""
    from audit.bench import run_audit_bench

    _report(run_audit_bench(sqlite_path=sqlite_path, postgres_url=postgres_url, records=records), json_out)


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
    import tempfile

    from audit.verify import verify_export

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "export.json"
        log.checkpoint()
        log.export(path)
        return bool(verify_export(path).ok)


# ---- gate -----------------------------------------------------------------------------------

@gate_app.command("scan")
def gate_scan(path: Path) -> None:
    """Scan a file as a tool result and print the report (secret values are masked)."""
    from gate import Gate

    _emit(Gate(gitleaks_config=_settings().gitleaks_config).scan(path.read_bytes()).to_dict())


@gate_app.command("eval")
def gate_eval(data: Annotated[Path, typer.Option(help="JSONL of {text, label}")],
              probe: Annotated[bool, typer.Option(help="score injection as the gateway does: the byte gate stacked "
                                                       "with the hidden-state probe (runs the model)")] = False,
              json_out: JsonFlag = False) -> None:
    """Precision, recall, FPR, recall at 1% FPR, ROC AUC and throughput per label."""
    import time

    from gate import Gate
    from gate.evaluate import load_rows, report, scan_rows

    rows = load_rows(data)
    started = time.perf_counter()
    scores, nbytes = scan_rows(rows, Gate(gitleaks_config=_settings().gitleaks_config))
    cached = False
    if probe:
        from gate.train.eval_full import stack_scores

        _, scores["injection"], cached = stack_scores(rows, scores["injection"], name=data.stem)
    result = report(data, rows, scores, nbytes, time.perf_counter() - started)
    result["injection_scorer"] = "stack(probe, byte gate)" if probe else "byte gate"
    if cached:
        result["note"] = "the probe read cached model states (var/probe_features/): throughput excludes the model pass"
    if json_out:
        _emit(result)
        return
    for label in ("injection", "secret"):
        typer.echo(f"{label:10} " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in result[label].items() if not isinstance(v, dict)))
    typer.echo(f"{result['documents']} documents, {result['megabytes']} MB, {result['throughput_mb_s']} MB/s; "
               f"injection scored by the {result['injection_scorer']}")


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

    from .app import open_signer

    s = _settings()
    log = AuditLog(s.audit_db_url, open_signer(s), origin=s.audit_origin)
    log.checkpoint()
    log.export(out)
    typer.echo(f"exported {log.size} records to {out}")


@audit_app.command("verify")
def audit_verify(export: Annotated[Optional[Path], typer.Option(help="an export file")] = None,
                 url: Annotated[Optional[str], typer.Option(help="a gateway URL to fetch the export from")] = None,
                 api_key: Annotated[Optional[str], typer.Option(envvar="LETHE_API_KEY")] = None,
                 trusted_checkpoint: Annotated[Optional[Path], typer.Option(help="a checkpoint you trust")] = None,
                 ) -> None:
    """Check signatures, the tree, every inclusion, consistency with a trusted checkpoint, and witnesses."""
    from audit.verify import verify_export, verify_url

    if (export is None) == (url is None):
        raise typer.BadParameter("give exactly one of --export FILE or --url URL")
    if export is not None:
        report = verify_export(export, trusted_checkpoint=trusted_checkpoint)
    else:
        report = verify_url(url or "", api_key=api_key or "", trusted_checkpoint=trusted_checkpoint)
    for error in report.errors:
        typer.echo(f"FAIL {error}", err=True)
    typer.echo(report.summary() if hasattr(report, "summary") else ("OK" if report.ok else "FAILED"))
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def demo(url: Annotated[Optional[str], typer.Option(help="use a running gateway instead of starting one")] = None,
         api_key: Annotated[Optional[str], typer.Option(envvar="LETHE_API_KEY")] = None) -> None:
    """Drive a scripted agent through the gateway with the official openai SDK, and print what happened."""
    from .demo import run_demo

    ok = run_demo(_settings(), url=url, api_key=api_key, out=sys.stdout)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    app()
