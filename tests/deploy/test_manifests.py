"""deploy/: the container images and the Kubernetes manifests, checked offline.

Every manifest is parsed (and validated against Kubernetes' JSON schemas when kubernetes-validate is
installed), and the references between them are followed: selectors and labels, Services and
ports, probes, the mounted server config (loaded by the project's own loader), the drain timeout
against the grace periods, the autoscaler's metric through the recording rule and prometheus-adapter,
the balancer's replica list against the autoscaler's maxReplicas, the Dockerfiles against the
README's install commands and the pods' command line. `haproxy -c` checks both balancer configs
when HAProxy is installed (Debian: apt-get install haproxy).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
FLAVOURS = ("cpu", "cuda")
DRAIN_MARGIN_S = 10  # terminationGracePeriodSeconds must exceed the drain timeout by at least this
CRD_GROUPS = ("monitoring.coreos.com/",)  # Prometheus Operator: no schema in kubernetes-validate


# --- loading -------------------------------------------------------------------------------------

def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))


def objects(flavour: str) -> list[dict]:
    """What `kubectl apply -f deploy/k8s -f deploy/k8s/<flavour>` creates."""
    files = sorted(K8S.glob("*.yaml")) + sorted((K8S / flavour).glob("*.yaml"))
    return [d for f in files for d in load_yaml_docs(f)]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    """A Service's selector (a plain mapping) or a LabelSelector (matchLabels only) picks `labels`."""
    assert "matchExpressions" not in selector, "matchExpressions: not handled by these checks"
    match = selector["matchLabels"] if "matchLabels" in selector else selector
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict, name: str) -> dict:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == name)


def port_number(ctr: dict, port) -> int:
    """A probe's or a Service's target port (a name or a number) as the container's port number."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in ctr["ports"]), f"no container port {port}"
        return port
    found = [p["containerPort"] for p in ctr["ports"] if p.get("name") == port]
    assert found, f"container {ctr['name']} has no port named {port!r}"
    return found[0]


def server_yaml_text(objs: list[dict]) -> str:
    """The server config the replicas mount (the ConfigMap behind --config)."""
    sts = one(objs, "StatefulSet", "duplex")
    cfg_path = arg_value(container(sts, "duplex")["args"], "--config")
    mount_dir, key = cfg_path.rsplit("/", 1)
    ctr = container(sts, "duplex")
    mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == mount_dir)
    volume = next(v for v in pod_spec(sts)["volumes"] if v["name"] == mount["name"])
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    items = volume["configMap"].get("items")
    if items:
        key = next(i["key"] for i in items if i["path"] == key)
    assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no key {key}"
    return cm["data"][key]


def arg_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# --- Dockerfiles -------------------------------------------------------------------------------

def dockerfile(flavour: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    out, buf = [], ""
    for line in (DEPLOY / f"Dockerfile.{flavour}").read_text().splitlines():
        if line.strip().startswith("#") or (not line.strip() and not buf):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not buf, "a continuation line ends the Dockerfile"
    return out


def instr(df: list[tuple[str, str]], name: str) -> list[str]:
    return [args for word, args in df if word == name]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


IMAGE_CMD = [".venv/bin/duplex", "serve", "--config", "/etc/duplex/server.yaml", "--host", "0.0.0.0"]
INSTALL = {"cpu": "bash scripts/install.sh", "cuda": "bash scripts/install.sh --cuda"}


# --- haproxy.cfg -------------------------------------------------------------------------------

def haproxy_sections(text: str) -> dict[str, list[str]]:
    """'kind name' -> its lines (comments and blank lines dropped, whitespace collapsed)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line:
            continue
        if not raw[0].isspace():
            current = " ".join(line.split()[:2])
            assert current not in sections, f"section {current} twice"
            sections[current] = []
        else:
            assert current is not None, raw
            sections[current].append(" ".join(line.split()))
    return sections


def servers(lines: list[str]) -> dict[str, list[str]]:
    """server name -> [address, options...] (shell-like split: the addresses are quoted)."""
    return {w[1]: w[2:] for w in (shlex.split(line) for line in lines if line.startswith("server "))}


def k8s_haproxy_cfg(objs: list[dict]) -> str:
    deploy = one(objs, "Deployment", "duplex-balancer")
    ctr = container(deploy, "haproxy")
    mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == "/usr/local/etc/haproxy")
    volume = next(v for v in pod_spec(deploy)["volumes"] if v["name"] == mount["name"])
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    assert any(i["key"] == "haproxy.cfg" and i["path"] == "haproxy.cfg" for i in volume["configMap"]["items"])
    return cm["data"]["haproxy.cfg"]


def routing(frontend: list[str]) -> list[str]:
    return [line for line in frontend if line.startswith(("http-request set-var(txn.replica)", "use_backend", "default_backend"))]


# The routing rules the loopback config (deploy/haproxy.cfg) and the k8s one share.
FRONTEND_RULES = [
    "http-request set-var(txn.replica) url_param(resume),field(2,.) if { url_param(resume) -m found }",
    "http-request set-var(txn.replica) path,field(5,/) if { path_beg /v1/telephony/twilio/ }",
    "use_backend replica_%[var(txn.replica)] if { var(txn.replica) -m found }",
    "default_backend replicas",
]


# --- every object ---------------------------------------------------------------------------------

def test_every_manifest_parses_into_named_kubernetes_objects() -> None:
    files = manifest_files()
    assert {f.relative_to(K8S).parts[0] for f in files} >= {"cpu", "cuda", "haproxy.yaml", "hpa.yaml"}
    for f in files:
        docs = load_yaml_docs(f)
        assert docs, f"{f}: no object"
        for d in docs:
            assert isinstance(d, dict), f"{f}: {d!r}"
            assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), f"{f}: {d.get('kind')}"
            assert "namespace" not in d["metadata"], f"{f}: objects go to the namespace kubectl applies them in"
    for flavour in FLAVOURS:
        keys = [(o["kind"], o["metadata"]["name"]) for o in objects(flavour)]
        assert len(keys) == len(set(keys)), f"{flavour}: an object twice: {keys}"


@pytest.mark.parametrize("version", ["1.29", "latest"])
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the test extra)")
    version = kv.latest_version() if version == "latest" else version
    for f in manifest_files():
        for d in load_yaml_docs(f):
            if d["apiVersion"].startswith(CRD_GROUPS):
                continue  # checked by hand below (test_scrape_and_recording_rule)
            try:
                kv.validate(d, version, strict=True)  # strict: an unknown (misspelt) field fails too
            except kv.ValidationError as e:
                pytest.fail(f"{f.relative_to(ROOT)}: {d['kind']}/{d['metadata']['name']} against Kubernetes {version}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}")


def test_the_flavours_differ_only_in_image_resources_and_gpu() -> None:
    cpu, cuda = (one(objects(f), "StatefulSet", "duplex") for f in FLAVOURS)
    assert container(cuda, "duplex")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert container(cpu, "duplex")["image"] == "duplex:cpu" and container(cuda, "duplex")["image"] == "duplex:cuda"

    def common(sts: dict) -> dict:
        sts = copy.deepcopy(sts)
        pod_spec(sts).pop("tolerations", None)
        for key in ("image", "resources"):
            container(sts, "duplex").pop(key)
        return sts

    assert common(cpu) == common(cuda)


# --- references between objects ------------------------------------------------------------------

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_selectors_and_labels_agree(flavour: str) -> None:
    objs = objects(flavour)
    sts = one(objs, "StatefulSet", "duplex")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(sts["spec"]["selector"], pod_labels)

    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # full/draining replicas keep their DNS name
    assert selects(headless["spec"]["selector"], pod_labels)

    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == sts["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1

    hpa = one(objs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (sts["apiVersion"], "StatefulSet", "duplex")
    assert "replicas" not in sts["spec"], "the HPA owns the replica count"

    balancer = one(objs, "Deployment", "duplex-balancer")
    balancer_labels = balancer["spec"]["template"]["metadata"]["labels"]
    assert selects(balancer["spec"]["selector"], balancer_labels)
    lb = one(objs, "Service", "duplex")
    assert lb["spec"]["type"] == "LoadBalancer"
    assert selects(lb["spec"]["selector"], balancer_labels) and not selects(lb["spec"]["selector"], pod_labels)
    for selector in (headless["spec"]["selector"], sts["spec"]["selector"], pdb["spec"]["selector"]):
        assert not selects(selector, balancer_labels), "the replicas' selectors must not pick the balancer's pods"

    for o in objs:  # one app, two components: every object says which
        assert o["metadata"]["labels"]["app.kubernetes.io/name"] == "duplex", o["metadata"]["name"]
        assert o["metadata"]["labels"]["app.kubernetes.io/component"] in ("server", "balancer"), o["metadata"]["name"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_probes_ports_and_the_server_port_agree(flavour: str) -> None:
    objs = objects(flavour)
    sts = one(objs, "StatefulSet", "duplex")
    ctr = container(sts, "duplex")
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/healthz"  # 503 at capacity / draining
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/livez"  # 200 while the process serves
    assert ctr["startupProbe"]["httpGet"]["path"] == "/livez"
    port = port_number(ctr, "http")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert port_number(ctr, ctr[probe]["httpGet"]["port"]) == port
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert [port_number(ctr, p["targetPort"]) for p in headless["spec"]["ports"]] == [port]

    config = yaml.safe_load(server_yaml_text(objs))
    assert config["server"]["port"] == port
    assert int(arg_value(ctr["args"], "--port")) == port
    assert arg_value(ctr["args"], "--host") == "0.0.0.0"

    balancer = one(objs, "Deployment", "duplex-balancer")
    hctr = container(balancer, "haproxy")
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(hctr, hctr[probe]["httpGet"]["port"]) == 8404
    lb = one(objs, "Service", "duplex")
    assert [port_number(hctr, p["targetPort"]) for p in lb["spec"]["ports"]] == [8080]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_pod_command_line_is_the_images_plus_what_differs_per_pod(flavour: str) -> None:
    objs = objects(flavour)
    ctr = container(one(objs, "StatefulSet", "duplex"), "duplex")
    args = ctr["args"]
    cmd = exec_form(instr(dockerfile(flavour), "CMD")[-1])
    assert "command" not in ctr and args[: len(cmd)] == cmd
    env = {e["name"]: e for e in ctr["env"]}
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert var in env, f"args use $({var}), which env does not define"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert arg_value(args, "--replica-id") == "$(POD_NAME)" and arg_value(args, "--token") == "$(DUPLEX_TOKEN)"
    secret = env["DUPLEX_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == ("duplex-token", "token")
    # the Secret is created by hand (deploy/README.md), not shipped with a placeholder value
    assert re.search(r"kubectl (-n \S+ )?create secret generic duplex-token --from-literal=token=", (DEPLOY / "README.md").read_text())
    assert not any(o["kind"] == "Secret" for o in objs)
    # the replica's name is the pod's: duplex-N, a DNS label
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", "duplex-" + str(max_replicas(objs) - 1))


def test_the_pod_command_line_parses_with_duplex_serve() -> None:
    import argparse

    from realtime.cli import serve

    parser = argparse.ArgumentParser(prog="duplex")
    commands = parser.add_subparsers(dest="command")
    serve.register(commands)
    known = {s for a in commands.choices["serve"]._actions for s in a.option_strings}  # noqa: SLF001
    args = container(one(objects("cuda"), "StatefulSet", "duplex"), "duplex")["args"]
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert flags <= known, f"`duplex serve` has no {', '.join(sorted(flags - known))}"
    expanded = [a.replace("$(POD_NAME)", "duplex-3").replace("$(DUPLEX_TOKEN)", "t0ken") for a in args]
    ns = parser.parse_args(expanded[1:])  # args[0] is the program
    assert ns.command == "serve" and ns.config == "/etc/duplex/server.yaml" and ns.token == "t0ken"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_grace_periods_cover_the_drain(flavour: str) -> None:
    objs = objects(flavour)
    limits = yaml.safe_load(server_yaml_text(objs)).get("limits") or {}
    assert "drain_timeout_s" in limits, "set limits.drain_timeout_s explicitly in the mounted config"
    drain = limits["drain_timeout_s"]
    grace = pod_spec(one(objs, "StatefulSet", "duplex"))["terminationGracePeriodSeconds"]
    assert grace >= drain + DRAIN_MARGIN_S, f"terminationGracePeriodSeconds {grace} < limits.drain_timeout_s {drain} + {DRAIN_MARGIN_S}"
    # the balancer lets calls through it finish too: hard-stop-after covers the drain, its grace covers that
    global_ = haproxy_sections(k8s_haproxy_cfg(objs))["global"]
    hard_stop = int(next(line for line in global_ if line.startswith("hard-stop-after ")).split()[1].rstrip("s"))
    assert hard_stop >= drain
    balancer = one(objs, "Deployment", "duplex-balancer")
    pre_stop = " ".join(container(balancer, "haproxy")["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -USR1 1" in pre_stop  # soft stop; SIGTERM would cut the calls
    sleep = sum(int(s) for s in re.findall(r"sleep (\d+);", pre_stop))
    assert pod_spec(balancer)["terminationGracePeriodSeconds"] >= sleep + hard_stop + DRAIN_MARGIN_S


def test_the_mounted_config_loads_with_the_servers_loader(tmp_path: Path) -> None:
    from realtime.config import load_config

    text = server_yaml_text(objects("cuda"))
    path = tmp_path / "server.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert cfg.server.port == 8000 and cfg.engine.model is None
    assert cfg.limits.drain_timeout_s == yaml.safe_load(text)["limits"]["drain_timeout_s"]


# --- autoscaling and metrics ----------------------------------------------------------------------

def max_replicas(objs: list[dict]) -> int:
    return one(objs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"]


def test_the_autoscaler_metric_is_the_recording_rule_served_by_the_adapter() -> None:
    objs = objects("cuda")
    hpa = one(objs, "HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    target = metric["pods"]["target"]["averageValue"]
    assert 0 < (int(target[:-1]) / 1000 if target.endswith("m") else float(target)) < 1
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

    rule = one(objs, "PrometheusRule")
    [recorded] = [r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    assert recorded["record"] == name
    used = set(re.findall(r"\bduplex_\w+", recorded["expr"]))
    assert used == {"duplex_sessions_active", "duplex_capacity"}
    metrics_src = (ROOT / "realtime" / "metrics.py").read_text()
    for m in used:  # the gauges the gateway exports under these names
        assert re.search(rf'Gauge\(\s*"{m}"', metrics_src), m

    values = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())
    [adapter_rule] = [r for r in values["rules"]["custom"] if r["name"]["as"] == name]
    assert re.match(rf"{name}\{{", adapter_rule["seriesQuery"]) and re.fullmatch(adapter_rule["name"]["matches"], name)
    assert adapter_rule["resources"]["overrides"]["pod"] == {"resource": "pod"}  # a Pods metric


def test_scrape_and_recording_rule() -> None:
    """The Prometheus Operator objects (no schema in kubernetes-validate): scraped Service and port,
    the bearer token /metrics needs."""
    objs = objects("cuda")
    sm = one(objs, "ServiceMonitor")
    scraped = [o for o in objs if o["kind"] == "Service" and selects(sm["spec"]["selector"], o["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in scraped] == [one(objs, "StatefulSet", "duplex")["spec"]["serviceName"]]
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["type"] == "Bearer"
    assert endpoint["authorization"]["credentials"] == {"name": "duplex-token", "key": "token"}
    for o in (sm, one(objs, "PrometheusRule")):
        assert o["apiVersion"] == "monitoring.coreos.com/v1"


# --- the balancer ---------------------------------------------------------------------------------

def test_the_balancer_lists_every_replica_the_autoscaler_may_start() -> None:
    objs = objects("cuda")
    sections = haproxy_sections(k8s_haproxy_cfg(objs))
    n = max_replicas(objs)
    sts = one(objs, "StatefulSet", "duplex")
    port = port_number(container(sts, "duplex"), "http")
    names = [f"duplex-{i}" for i in range(n)]  # the StatefulSet's pods
    address = {name: f"{name}.${{DUPLEX_REPLICAS_DOMAIN}}:{port}" for name in names}

    frontend = sections["frontend duplex"]
    assert routing(frontend) == FRONTEND_RULES
    assert any("init-addr none" in line and "resolvers kube-dns" in line for line in sections["defaults"] if line.startswith("default-server"))
    assert "resolvers kube-dns" in sections

    new = sections["backend replicas"]
    assert "option httpchk GET /healthz" in new and "http-check expect status 200" in new
    srv = servers(new)
    assert sorted(srv) == sorted(names + [f"{name}-full" for name in names]), "servers for duplex-0 .. duplex-<maxReplicas - 1>"
    for name in names:
        assert srv[name][0] == address[name] and "check" in srv[name] and "backup" not in srv[name]
        full = srv[f"{name}-full"]
        assert full[0] == address[name] and "backup" in full and full[full.index("track") + 1] == f"replica_{name}/{name}"

    owned = {k.split()[1] for k in sections if k.startswith("backend replica_")}
    assert owned == {f"replica_{name}" for name in names}, "one replica_<name> backend per server in `replicas`"
    for name in names:
        lines = sections[f"backend replica_{name}"]
        assert "option httpchk GET /livez" in lines
        assert servers(lines) == {name: [address[name], "check", "inter", "1s", "fall", "2", "rise", "1"]}

    # the addresses resolve to the StatefulSet's pods: <pod>.<headless Service>.<namespace>.svc...
    env = {e["name"]: e for e in container(one(objs, "Deployment", "duplex-balancer"), "haproxy")["env"]}
    assert env["DUPLEX_REPLICAS_DOMAIN"]["value"].startswith(f"{sts['spec']['serviceName']}.$(POD_NAMESPACE).svc.")
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert sts["metadata"]["name"] == "duplex"
    binds = [line.split()[1] for line in frontend if line.startswith("bind ")]
    assert binds == [":8080"] and port_number(container(one(objs, "Deployment", "duplex-balancer"), "haproxy"), "http") == 8080


def test_the_loopback_balancer_uses_the_same_frontend_rules() -> None:
    path = DEPLOY / "haproxy.cfg"
    frontend = haproxy_sections(path.read_text())["frontend duplex"]
    assert routing(frontend) == FRONTEND_RULES


def _haproxy_check(cfg: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["haproxy", "-dW", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (Debian: apt-get install haproxy)")
def test_haproxy_accepts_the_k8s_config_before_any_replica_resolves(tmp_path: Path) -> None:
    """-dW: warnings fail too. The replicas' names do not resolve here, as for replicas the
    autoscaler has not started: `init-addr none` leaves them down instead of failing the start
    (without it, HAProxy 2.6 warns "could not resolve address ..., disabling server" for each, after
    a DNS lookup that can take seconds where no DNS server answers, so that case is not run here)."""
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(k8s_haproxy_cfg(objects("cuda")))
    ok = _haproxy_check(cfg, DUPLEX_REPLICAS_DOMAIN="duplex-replicas.duplex-test.svc.cluster.local")
    assert ok.returncode == 0, ok.stdout + ok.stderr


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (Debian: apt-get install haproxy)")
def test_haproxy_accepts_the_loopback_config() -> None:
    path = DEPLOY / "haproxy.cfg"
    # the addresses come from the environment (deploy/haproxy.cfg's header), as realtime/soak/balancer.py sets them
    result = _haproxy_check(path, DUPLEX_LB_BIND="127.0.0.1:8080", DUPLEX_0="127.0.0.1:8001", DUPLEX_1="127.0.0.1:8002")
    assert result.returncode == 0, result.stdout + result.stderr


# --- images ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_dockerfile_installs_with_the_readmes_command_and_runs_what_the_pods_run(flavour: str) -> None:
    df = dockerfile(flavour)
    assert df[0][0] == "FROM" and instr(df, "FROM") == ["python:3.11-slim-bookworm"]  # install.sh wants 3.11
    runs = instr(df, "RUN")
    [install] = [r for r in runs if "scripts/install.sh" in r]
    command = re.search(r"bash scripts/install\.sh[^;&|]*", install).group(0).strip()
    assert command == INSTALL[flavour]
    assert command in (ROOT / "README.md").read_text(), "the Dockerfile installs with the README's command"
    assert any(re.search(r"apt-get install .*\blibopus0\b", r) for r in runs)  # opuslib needs it
    assert instr(df, "WORKDIR") == ["/app"]

    users = instr(df, "USER")
    assert users and users[-1] not in ("root", "0")
    uid = re.search(rf"useradd .*--uid (\d+) .*\b{users[-1]}\b", " ".join(runs)).group(1)
    for f in FLAVOURS:
        assert pod_spec(one(objects(f), "StatefulSet", "duplex"))["securityContext"]["runAsUser"] == int(uid)
    words = [w for w, _ in df]
    assert max(i for i, w in enumerate(words) if w == "USER") < df.index(("RUN", install)), "install as the user, not root"

    assert exec_form(instr(df, "CMD")[-1]) == IMAGE_CMD
    config_path = arg_value(IMAGE_CMD, "--config")
    assert any(c.split()[-1] == config_path for c in instr(df, "COPY")), "a default config at the CMD's --config"
    ctr = container(one(objects(flavour), "StatefulSet", "duplex"), "duplex")
    assert ctr["image"] == f"duplex:{flavour}"
    port = port_number(ctr, "http")
    assert instr(df, "EXPOSE") == [f"{port}/tcp"]
    [health] = instr(df, "HEALTHCHECK")
    assert f"http://127.0.0.1:{port}/livez" in health and " CMD [" in health
    readme = (DEPLOY / "README.md").read_text()
    assert f"docker build -f deploy/Dockerfile.{flavour} -t duplex:{flavour} ." in readme


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rules: the last matching pattern wins, `!` re-includes, a pattern that matches a
    directory covers what is under it, `**` spans directories."""
    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            else:
                out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
                i += 1
        return re.compile(out)

    parts = path.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    result = False
    for p in patterns:
        if any(regex(p.lstrip("!")).fullmatch(c) for c in prefixes):
            result = not p.startswith("!")
    return result


def test_dockerignore_keeps_the_sources_and_drops_the_rest() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    for path in (".venv/bin/python", ".venv", "artifacts/soak/report.json", "engine/__pycache__/x.pyc", ".git/HEAD",
                 "duplex.egg-info/PKG-INFO", "realtime/x.pyc", "out.wav", "tests/x/y.npy", ".pytest_cache/v"):
        assert dockerignored(path, patterns), path
    for path in ("pyproject.toml", "scripts/install.sh", "engine/tiny.py", "realtime/config.py", "configs/server.yaml",
                 "README.md", "tests/assets/speech.wav", "deploy/Dockerfile.cpu"):
        assert not dockerignored(path, patterns), path


def test_the_deploy_readme_names_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for f in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.name != "README.md"):
        assert str(f.relative_to(DEPLOY)) in readme, f"deploy/README.md does not mention {f.relative_to(DEPLOY)}"
