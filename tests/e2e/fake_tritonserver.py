"""A stand-in for tritonserver, for testing the launcher's restarts in a second: it takes the
flags the launcher passes, answers /v2/health/ready and /v2/models/<m>/ready on --http-port,
leaves a python-backend-like region in /dev/shm under the launcher's prefix, and misbehaves as
the environment says:
  FAKE_LIFETIME_S      exit after this long, with FAKE_EXIT_CODE (default 3)
  FAKE_UNREADY_AFTER_S every model answers "not ready" (400) from then on, the server stays up
  FAKE_RUNS_FILE       each run appends a line: its pid and a digest of its control secret
Run it as `python fake_tritonserver.py <tritonserver flags>`.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import sys
import threading
import time
from pathlib import Path

from ensemble.control import SECRET_ENV_VAR


def flag(name: str, default: str = "") -> str:
    for arg in sys.argv[1:]:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return default


def main() -> None:
    started_s = time.monotonic()
    unready_after_s = float(os.environ.get("FAKE_UNREADY_AFTER_S", "inf"))
    if os.environ.get("FAKE_RUNS_FILE"):
        digest = hashlib.sha256(os.environ.get(SECRET_ENV_VAR, "").encode()).hexdigest()[:16]
        with open(os.environ["FAKE_RUNS_FILE"], "a") as runs:
            runs.write(f"{os.getpid()} {digest}\n")
    prefix = flag("backend-config").partition("shm-region-prefix-name=")[2]
    region = Path("/dev/shm") / f"{prefix}fake-{os.getpid()}"
    region.write_bytes(b"\0" * 16)
    holder = open(region, "rb")  # noqa: SIM115 - held open as a live server's regions are

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            is_unready = self.path.startswith("/v2/models/") and time.monotonic() - started_s > unready_after_s
            self.send_response(400 if is_unready else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(flag("http-port"))), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lifetime_s = float(os.environ.get("FAKE_LIFETIME_S", "inf"))
    time.sleep(lifetime_s if lifetime_s < 1e9 else 1e9)
    holder.close()
    os._exit(int(os.environ.get("FAKE_EXIT_CODE", "3")))  # a crash: the region stays behind


if __name__ == "__main__":
    main()
