"""HAProxy (Debian's `haproxy`) with deploy/haproxy.cfg in front of two `duplex serve` replicas on
loopback: the balancer of docs/scaling.md, for the scaling test and `scripts/scale_run.py`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
REPLICAS = ("duplex-0", "duplex-1")  # the server names deploy/haproxy.cfg lists


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Balancer:
    """`haproxy -f deploy/haproxy.cfg` on 127.0.0.1:`port`, routing to `replica_ports` (duplex-0, duplex-1)."""

    def __init__(self, replica_ports: list[int], port: int | None = None) -> None:
        exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
        if not Path(exe).exists():
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy; scripts/install.sh --system)")
        self.port = port or free_port()
        env = {**os.environ, "DUPLEX_LB_BIND": f"127.0.0.1:{self.port}",
               **{f"DUPLEX_{i}": f"127.0.0.1:{p}" for i, p in enumerate(replica_ports)}}
        self.log_path = Path(tempfile.mkdtemp(prefix="duplex-lb-")) / "haproxy.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([exe, "-db", "-f", str(CONFIG)], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_routable(self, timeout_s: float = 30.0) -> None:
        """Until a /healthz through the balancer answers 200 (a replica's check passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited ({self.proc.returncode}):\n{self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"no replica routable through haproxy in {timeout_s:.0f} s:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
