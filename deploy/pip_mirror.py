"""Serve the host's pip configuration to an image build over loopback HTTP.

A build container cannot read the host's `file://` indexes, `--find-links` folders or its CA
bundle. This mirrors them: each local folder the host's pip uses is served under
http://127.0.0.1:PORT/<n>/ (an index with its parent folder), the CA bundle at /ca.pem, and the matching build arguments are written
to the file named by --args (one NAME=VALUE per line). Remote URLs are passed on as
they are. The build must use `--network host` to reach the server. Serves until killed.

    python3 deploy/pip_mirror.py --port 18185 --args /tmp/build-args
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def pip_config() -> dict[str, str]:
    """The host's effective pip settings: environment over the config files (`pip config list`)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, dict[str, str]] = {"env": {}, "file": {}}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        found["env" if scope.startswith(":env:") else "file"][key] = value.strip().strip("'\"")
    return {**found["file"], **found["env"]}


class Mirror:
    """Local paths named by pip settings, each given a URL under this server."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.roots: dict[str, Path] = {}

    def url(self, location: str, *, index: bool) -> str:
        parsed = urlparse(location)
        if parsed.scheme not in ("", "file"):
            return location
        path = Path(parsed.path if parsed.scheme else location)
        name = str(len(self.roots))
        if not index:
            self.roots[name] = path
            return f"{self.base}/{name}/"
        # an index is served with its parent: its pages may link to "../../files/..." beside it
        self.roots[name] = path.parent
        return f"{self.base}/{name}/{path.name}/"

    def build_args(self, config: dict[str, str]) -> list[str]:
        args = []
        for key, arg in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                         ("find-links", "PIP_FIND_LINKS")):
            if config.get(key):
                urls = [self.url(v, index=key != "find-links") for v in config[key].split()]
                args.append(f"{arg}={' '.join(urls)}")
        if config.get("cert"):
            self.roots["ca.pem"] = Path(config["cert"])
            args.append(f"PIP_CERT_URL={self.base}/ca.pem")
        return args


class Handler(SimpleHTTPRequestHandler):
    roots: dict[str, Path] = {}

    def translate_path(self, path: str) -> str:
        head, _, rest = unquote(path.lstrip("/").split("?")[0]).partition("/")
        root = self.roots.get(head)
        if root is None:
            return "/nonexistent"
        target = (root / rest).resolve()
        return str(target) if target.is_relative_to(root.resolve()) else "/nonexistent"

    def log_message(self, format: str, *args: object) -> None:  # quiet: the build prints progress
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18185)
    parser.add_argument("--args", type=Path, required=True, help="where to write the build arguments")
    opts = parser.parse_args()
    mirror = Mirror(opts.port)
    args = mirror.build_args(pip_config())
    server = ThreadingHTTPServer(("127.0.0.1", opts.port), functools.partial(Handler))
    Handler.roots = mirror.roots
    opts.args.write_text("".join(f"{a}\n" for a in args))
    print(f"pip mirror on {mirror.base}: " + ", ".join(f"/{k} -> {v}" for k, v in mirror.roots.items()),
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        os.unlink(opts.args) if opts.args.exists() else None


if __name__ == "__main__":
    main()
