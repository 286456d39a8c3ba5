"""A stand-in for a service, run by the supervisor tests as `python -m cli_fake_component <name> grpc|http`.

It behaves like the real contract (prefixed env vars, port file, health, graceful SIGTERM) and records
what it saw under its data dir. `FAKE_<NAME>_MODE` (inherited from the test) makes it misbehave:
`crash` exits 3 at once, `unready` never reports healthy, `exit-later` exits 4 after a second,
`stubborn` ignores SIGTERM. `python -m cli_fake_component migrate|cleanup` records its command line
and `ALPHA_*`/`BETA_*` environment in `FAKE_COMMAND_RECORD` and exits with `FAKE_COMMAND_EXIT`.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

RECORDED_PREFIXES = ("ALPHA_", "BETA_")


def _record(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(content)


def _write_port(data_dir: Path, name: str, port: int) -> None:
    run_dir = data_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    scratch = run_dir / f"{name}.tmp"
    scratch.write_text(str(port))
    scratch.replace(run_dir / f"{name}.port")


def _serve_grpc(host: str, port: int, ready: bool) -> tuple[int, object]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    servicer.set("", status)
    bound: int = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return bound, server


def _serve_http(host: str, port: int, ready: bool) -> tuple[int, object]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code = 200 if ready and self.path == "/readyz" else 503
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1], server


def main() -> int:
    """Run as the component named on the command line until SIGTERM."""
    if sys.argv[1] in ("migrate", "cleanup"):
        seen = {key: value for key, value in os.environ.items() if key.startswith(RECORDED_PREFIXES)}
        _record(Path(os.environ["FAKE_COMMAND_RECORD"]), json.dumps({"argv": sys.argv[1:], "env": seen}))
        return int(os.environ.get("FAKE_COMMAND_EXIT", "0"))
    name, protocol = sys.argv[1], sys.argv[2]
    prefix = f"{name.upper()}_"
    mode = os.environ.get(f"FAKE_{name.upper()}_MODE", "ok")
    data_dir = Path(os.environ[f"{prefix}DATA_DIR"])
    seen = {key: value for key, value in os.environ.items() if key.startswith(RECORDED_PREFIXES)}
    _record(data_dir / f"{name}.env.json", json.dumps(seen))
    if mode == "crash":
        print(f"{name}: boom", file=sys.stderr)
        return 3

    stopping = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else on_term)
    serve = _serve_grpc if protocol == "grpc" else _serve_http
    port, _server = serve(os.environ[f"{prefix}HOST"], int(os.environ[f"{prefix}PORT"]), mode != "unready")
    _write_port(data_dir, name, port)
    started = time.monotonic()
    while not stopping.is_set():
        if mode == "exit-later" and time.monotonic() - started > 1.0:
            return 4
        time.sleep(0.05)
    _record(data_dir / "stops.log", f"{name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
