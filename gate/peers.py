"""Secrets side by side with two popular scanners, CredSweeper and detect-secrets, on the same files.

    python -m gate.bench peers --bin /path/to/peers-venv/bin [--megabytes 10]

The peers are not project dependencies: install them into a separate environment and point
``--bin`` (or ``LETHE_PEERS_BIN``) at its ``bin`` directory; a peer that is not found is reported
as skipped, with the command that installs it. Every scanner reads the very same files written to
a temporary directory:
  * credentials: ``gate.train.secretgen.corpus`` (every format, each in the seven carriers), one
    file per credential named as its carrier is on disk (``.env``, ``config.yaml``,
    ``.aws/credentials``, ``.bash_history``, ``docker-compose.yml``, ``app.log``, ``config.json``);
  * benign text: ``gate.evaluate.package_text`` (real source, docs, JSON and RECORD files of the
    installed packages) and ``secretgen.lookalikes`` (lockfile hashes, digests, documentation keys).
The scanners report lines, so all three are scored by lines: a credential is found when a
finding's line falls inside the lines its value occupies; every finding in a benign file is a
false positive (counted per 10 MB) and the files flagged are counted too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from .core import Gate

CARRIER_FILES = {"env": ".env", "yaml": "config.yaml", "aws_ini": ".aws/credentials", "shell": ".bash_history",
                 "compose": "docker-compose.yml", "log": "app.log", "json": "config.json"}
INSTALL = "python -m venv peers-venv && peers-venv/bin/pip install credsweeper detect-secrets"
Findings = dict[str, set[int]]  # relative path -> 1-based line numbers reported


def peer_bins(bin_dir: Path | None) -> dict[str, str | None]:
    """The peers' executables: in ``bin_dir`` (or ``LETHE_PEERS_BIN``), else on PATH; None if absent."""
    where = bin_dir or (Path(os.environ["LETHE_PEERS_BIN"]) if os.environ.get("LETHE_PEERS_BIN") else None)
    found = {}
    for name in ("credsweeper", "detect-secrets"):
        path = where / name if where else None
        found[name] = str(path) if path and path.is_file() else (None if where else shutil.which(name))
    return found


def write_corpus(root: Path, megabytes: float, per_format: int) -> tuple[list[dict], list[str], list[str], int]:
    """Credential files (with the lines their value occupies), package text and look-alike files."""
    from .evaluate import package_text
    from .train import secretgen

    creds = []
    for i, row in enumerate(secretgen.corpus(per_format=per_format)):
        rel = f"cred/{i:05d}/{CARRIER_FILES[row['carrier']]}"
        _write(root / rel, row["text"].encode())
        creds.append({**row, "path": rel, "lines": _value_lines(row["text"], row["secret"])})
    benign, size = [], 0
    for i, (name, data) in enumerate(package_text(megabytes)):
        rel = f"pkg/{i:05d}/{Path(name).name}"
        _write(root / rel, data)
        benign.append(rel)
        size += len(data)
    look = []
    for i, text in enumerate(secretgen.lookalikes()):
        rel = f"look/{i:05d}/{['poetry.lock', 'package-lock.json', 'requirements.txt', 'commit.txt', 'access.log', 'README.md', 'notes.md', 'settings.yaml', 'manifest.yaml', 'key.pub', 'cert.pem', 'authorized_keys'][i % 12]}"
        _write(root / rel, text.encode())
        look.append(rel)
    return creds, benign, look, size


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _value_lines(text: str, secret: str) -> range:
    """1-based lines the secret's value occupies in its carrier (a JSON carrier escapes newlines)."""
    first = secret.split("\n")[0]
    start = text.find(first)
    if start < 0:
        first = first.split(": ", 1)[-1]
        start = text.find(first)
    if start < 0:
        return range(0)
    line = text.count("\n", 0, start) + 1
    return range(line, line + len(text[start : start + len(secret)].splitlines() or [""]))


def scan_lethe(root: Path, paths: list[str]) -> Findings:
    """The gate's secret findings, as the lines their bytes cover."""
    gate = Gate()
    out: Findings = defaultdict(set)
    for rel in paths:
        data = (root / rel).read_bytes()
        for f in gate.scan(data).findings:
            if f.kind == "secret":
                a, b = data.count(b"\n", 0, f.byte_start) + 1, data.count(b"\n", 0, max(f.byte_start, f.byte_end - 1)) + 1
                out[rel].update(range(a, b + 1))
    return out


def scan_credsweeper(exe: str, root: Path, jobs: int = 2) -> Findings:
    """CredSweeper with its defaults (ML validation on), every candidate it reports."""
    report = root.parent / "credsweeper.json"
    subprocess.run([exe, "--path", str(root), "--save-json", str(report), "--no-stdout", "--jobs", str(jobs)],
                   check=True, capture_output=True)
    out = defaultdict(set)
    for cand in json.loads(report.read_text()):
        for ld in cand["line_data_list"]:
            out[str(Path(ld["path"]).resolve().relative_to(root.resolve()))].add(int(ld["line_num"]))
    return out


def scan_detect_secrets(exe: str, root: Path) -> Findings:
    """detect-secrets with its default plugins and filters, ``--all-files``."""
    proc = subprocess.run([exe, "scan", "--all-files", "."], cwd=root, check=True, capture_output=True, text=True)
    out: Findings = defaultdict(set)
    for path, hits in json.loads(proc.stdout)["results"].items():
        out[str(Path(path))].update(int(h["line_number"]) for h in hits)
    return out


def score(found: Findings, creds: list[dict], benign: list[str], look: list[str], benign_bytes: int) -> dict:
    """Recall by lines, per format below 1, and false positives per 10 MB of package text."""
    hits = {c.get("key", c["path"]): bool(found.get(c["path"], set()) & set(c["lines"])) for c in creds}
    by_format: dict[str, list[bool]] = defaultdict(list)
    for c in creds:
        by_format[c["format"]].append(hits[c.get("key", c["path"])])
    fps = sum(len(found.get(p, ())) for p in benign)
    return {"recall": round(sum(hits.values()) / len(creds), 4),
            "formats_below_1": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_format.items()) if not all(v)},
            "benign_findings": fps, "benign_files_flagged": sum(bool(found.get(p)) for p in benign),
            "false_positives_per_10mb": round(fps / benign_bytes * 1e7, 2),
            "lookalike_documents_flagged": sum(bool(found.get(p)) for p in look)}


def write_sets(root: Path, names: tuple[str, ...]) -> tuple[list[dict], list[str], list[str], int]:
    """The blind sets' rows (``gate.evaluate.BLIND_SECRET_SETS``), one file each (``output.txt``:
    a tool's output has no file name of its own), with the lines each labelled value occupies."""
    from .evaluate import DATA_DIR, load_rows

    creds, benign, size = [], [], 0
    for name in names:
        for i, row in enumerate(load_rows(DATA_DIR / name)):
            rel = f"{Path(name).stem}/{i:04d}/output.txt"
            _write(root / rel, row["text"].encode())
            if row["label"] == "benign":
                benign.append(rel)
                size += len(row["text"].encode())
                continue
            creds += [{"format": s["format"], "path": rel, "key": f"{rel}#{k}", "lines": _value_lines(row["text"], s["value"])}
                      for k, s in enumerate(row["secrets"])]
    return creds, benign, [], size


def run_peers_bench(bin_dir: Path | None = None, *, megabytes: float = 10.0, per_format: int = 7, progress: bool = True,
                    sets: tuple[str, ...] = ()) -> dict:
    """The generated corpus (default) or, with `sets`, the sets written blind, through every scanner."""
    say = (lambda *a: print(*a, file=sys.stderr)) if progress else (lambda *a: None)
    bins = peer_bins(bin_dir)
    with tempfile.TemporaryDirectory(prefix="lethe-peers-") as tmp:
        root = Path(tmp) / "corpus"
        creds, benign, look, size = write_sets(root, sets) if sets else write_corpus(root, megabytes, per_format)
        say(f"corpus: {len(creds)} credential files, {len(benign)} package files ({size / 1e6:.1f} MB), {len(look)} look-alikes")
        scanners = {"lethe_gate": lambda: scan_lethe(root, [c["path"] for c in creds] + benign + look),
                    "credsweeper": lambda: scan_credsweeper(bins["credsweeper"] or "", root),  # run only when found
                    "detect_secrets": lambda: scan_detect_secrets(bins["detect-secrets"] or "", root)}
        result: dict = {"credentials": len(creds), "formats": len({c["format"] for c in creds}), "carriers": sorted(CARRIER_FILES),
                        "benign_megabytes": round(size / 1e6, 2), "benign_files": len(benign), "lookalike_documents": len(look),
                        "scoring": "by lines: a credential counts when a finding's line is inside its value's lines"}
        for name, run in scanners.items():
            exe = bins.get(name.replace("_", "-"), "in-process") if name != "lethe_gate" else "in-process"
            if exe is None:
                result[name] = {"skipped": f"{name.replace('_', '-')} not found (pass --bin or set LETHE_PEERS_BIN); install it "
                                           f"outside the project's environment: {INSTALL}"}
                say(result[name]["skipped"])
                continue
            t0 = time.time()
            result[name] = score(run(), creds, benign, look, size) | {"wall_s": round(time.time() - t0, 1)}
            say(f"{name}: recall {result[name]['recall']}, {result[name]['false_positives_per_10mb']} FP/10 MB")
    result["versions"] = {name: _version(exe) for name, exe in bins.items() if exe}
    return result


def _version(exe: str) -> str:
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return (proc.stdout or proc.stderr).strip().splitlines()[-1] if proc.returncode == 0 else "unknown"
