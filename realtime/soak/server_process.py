"""The server under a soak or fault run: `duplex serve` started and stopped (`ServerProcess`), and
its probes: /healthz, /metrics, and the RSS and open file descriptors of its process tree."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path


class ServerProcess:
    """`duplex serve` started for this run (port chosen by the OS)."""

    def __init__(self, config: dict, token: str, port: int = 0, replica_id: str | None = None) -> None:
        """`port` 0: the OS picks one; `replica_id`: `--replica-id` (behind a load balancer)."""
        import yaml

        self.dir = Path(tempfile.mkdtemp(prefix="duplex-soak-"))
        (self.dir / "server.yaml").write_text(yaml.safe_dump(config))
        duplex = Path(sys.executable).parent / "duplex"
        args = [str(duplex), "serve", "--config", str(self.dir / "server.yaml"), "--port", str(port), f"--token={token}"]
        if replica_id:
            args.append(f"--replica-id={replica_id}")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log_path = self.dir / "server.log"
        stdout = self.proc.stdout
        assert stdout is not None  # stdout=PIPE
        base: str | None = None
        ready = threading.Event()

        def pump() -> None:
            nonlocal base
            with open(self.log_path, "w") as log:
                for line in stdout:
                    log.write(line)
                    log.flush()
                    if "demo page:" in line and base is None:
                        base = line.split("demo page:")[1].strip().split("/?")[0]
                        ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(300) or base is None:
            self.stop()
            raise RuntimeError(f"duplex serve did not start (log: {self.log_path}):\n{self.log_tail()}")
        self.base: str = base  # http://host:port, from the server's "demo page:" line

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-lines:])

    @property
    def port(self) -> int:
        """The port it serves on (the OS's choice when started with port 0)."""
        return int(self.base.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int | None:
        """SIGTERM (a drain: at once when no session is open), then the exit status (None: killed after 60 s)."""
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None

    def kill(self) -> None:
        """SIGKILL to the gateway and its engine core, as a machine's crash would: nothing is closed."""
        for pid in reversed(process_tree(self.proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (the gateway and vLLM's engine-core process)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_sample(pid: int) -> dict:
    def rss_mib(p: int) -> float:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        return 0.0

    try:
        tree = process_tree(pid)
        return {"rss_mib": rss_mib(pid), "rss_tree_mib": sum(rss_mib(p) for p in tree if Path(f"/proc/{p}").exists()),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:
        return {}


def read_metrics(base: str, token: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (our counters only)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("duplex_") and not line.startswith("#"):
            m = re.match(r"(\S+)\s+(\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def health(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: starting, stopping or at capacity; the body says which
        try:
            return json.loads(e.read())
        except ValueError:
            return {"ready": False, "detail": f"HTTP {e.code}"}
    except Exception as e:  # the server may be down: that is the finding
        return {"ready": False, "detail": str(e)}
