"""Checks of deploy files that need a YAML parser or the Prometheus operator's models.

Run with the test tools' virtualenv (scripts/test-tools install), by cmd/derpd/tests/deploy.rs:

  check.py crds FILE...            every monitoring.coreos.com/v1 document in the files is a
                                   valid ServiceMonitor or PrometheusRule (unknown fields are
                                   errors, not ignored)
  check.py rule-spec RULE.yaml     print the PrometheusRule's spec (for promtool)
  check.py same-rules A.yml B.yml  the two rule files (or a PrometheusRule's spec) hold the
                                   same groups
  check.py render-rule ALERTS.yml  print the PrometheusRule carrying ALERTS.yml's groups
  check.py region RENDERED.yaml N  check that a rendered region (kubectl kustomize output)
                                   hangs together, and print as JSON the command line pod N
                                   runs, with $(VAR) expanded as Kubernetes does
  check.py derpmap MAP.json RENDERED.yaml
                                   the DERP map lists exactly the region's nodes
"""

import json
import re

import sys

import yaml


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def groups_of(path):
    docs = load_all(path)
    if len(docs) != 1:
        sys.exit(f"{path}: want one document, found {len(docs)}")
    doc = docs[0]
    if doc.get("kind") == "PrometheusRule":
        doc = doc["spec"]
    return doc["groups"]


def crds(paths):
    import pydantic
    from cloudcoil.models.prometheus_operator import v1

    models = [
        m for m in vars(v1).values() if isinstance(m, type) and issubclass(m, pydantic.BaseModel)
    ]
    # The models accept unknown keys by default; a typo must fail instead.
    for m in models:
        m.model_config["extra"] = "forbid"
    for m in models:
        m.model_rebuild(force=True)
    ok, seen = True, 0
    for path in paths:
        for doc in load_all(path):
            if not str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
                continue
            seen += 1
            kind = doc.get("kind")
            model = getattr(v1, str(kind), None)
            if doc["apiVersion"] != "monitoring.coreos.com/v1" or model is None:
                ok = False
                print(f"ERROR {path}: unknown {doc['apiVersion']} kind {kind}")
                continue
            try:
                model.model_validate(doc)
                print(f"OK {path} {kind}/{doc['metadata']['name']}")
            except Exception as e:  # the model's own error text says what is wrong
                ok = False
                detail = " | ".join(str(e).splitlines())
                print(f"ERROR {path} {kind}: {detail}")
    print(f"{seen} custom resource(s) checked")
    sys.exit(0 if ok else 1)


RULE_HEADER = """\
# The alerting rules of deploy/prometheus/alerts.yml, for the Prometheus operator. Do not edit
# by hand: edit alerts.yml, then regenerate this file with
#   .test-tools/venv/bin/python cmd/derpd/tests/deploy/check.py render-rule \\
#     deploy/prometheus/alerts.yml > deploy/kubernetes/components/prometheus-operator/prometheusrule.yaml
# (a test fails while the two differ). Your Prometheus may select rules by a label
# (kube-prometheus-stack: release=<its release>): add it in your overlay.
"""


def render_rule(path):
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "derpd", "labels": {"app.kubernetes.io/name": "derpd"}},
        "spec": {"groups": groups_of(path)},
    }
    sys.stdout.write(RULE_HEADER)
    yaml.safe_dump(rule, sys.stdout, sort_keys=False, width=100)


def fail(msg):
    sys.exit(f"ERROR {msg}")


def expand(text, env):
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ is a literal $, unknown
    references stay as they are."""

    def one(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def region(path, pod):
    docs = load_all(path)
    [sts] = by_kind(docs, "StatefulSet")
    spec = sts["spec"]
    tmpl = spec["template"]
    pod_labels = tmpl["metadata"]["labels"]
    replicas = spec["replicas"]
    ns = sts["metadata"]["namespace"]
    name = sts["metadata"]["name"]
    pod_name = f"{name}-{pod}"
    if not 0 <= pod < replicas:
        fail(f"pod {pod} is not one of the {replicas} replicas")
    if spec["selector"]["matchLabels"].items() - pod_labels.items():
        fail("the StatefulSet's selector does not select its own pods")

    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    headless = services.get(spec["serviceName"])
    if not headless or headless["spec"].get("clusterIP") != "None":
        fail(f"serviceName {spec['serviceName']} is not a headless Service")
    if not headless["spec"].get("publishNotReadyAddresses"):
        fail("the headless Service must publish pods before they are ready (mesh links)")
    # Per-node Services (absent with host networking): exactly one per pod.
    nodes = [
        d for d in services.values()
        if "statefulset.kubernetes.io/pod-name" in d["spec"].get("selector", {})
    ]
    if nodes:
        selected = sorted(d["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] for d in nodes)
        want = sorted(f"{name}-{i}" for i in range(replicas))
        if selected != want:
            fail(f"per-node Services select {selected}, the pods are {want}")
        for d in nodes:
            protos = {(p["port"], p["protocol"]) for p in d["spec"]["ports"]}
            for need in [(443, "TCP"), (443, "UDP"), (80, "TCP"), (3478, "UDP")]:
                if need not in protos:
                    fail(f"Service {d['metadata']['name']} lacks {need[0]}/{need[1]}")
            if d["spec"].get("externalTrafficPolicy") != "Local":
                fail(f"Service {d['metadata']['name']}: clients' addresses must be kept (Local)")
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        if pdb["spec"]["selector"]["matchLabels"].items() - pod_labels.items():
            fail("the PodDisruptionBudget does not select the pods")

    [c] = tmpl["spec"]["containers"]
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        port = c[probe]["httpGet"]["port"]
        if port not in ports:
            fail(f"{probe} uses port {port}, which the container does not name")
    if c["readinessProbe"]["httpGet"]["path"] != "/derp/probe":
        fail("readiness must come from /derp/probe")

    maps = {d["metadata"]["name"]: d.get("data", {}) for d in by_kind(docs, "ConfigMap")}
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            field = src["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod_name, "status.hostIP": "127.0.0.1",
                              "metadata.namespace": ns}[field]
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            if ref["name"] not in maps or ref["key"] not in maps[ref["name"]]:
                fail(f"env {e['name']}: no ConfigMap {ref['name']} key {ref['key']}")
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        else:
            fail(f"env {e['name']}: unexpected source {src}")
    args = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
    for a in args:
        if "$(" in a:
            fail(f"argument {a!r} refers to a variable that is not defined before it")

    flags = dict(a[2:].split("=", 1) for a in args[1:] if a.startswith("--") and "=" in a)
    mesh = flags.get("mesh-with", "").split(",")
    domain = flags["hostname"].split(".", 1)[1]
    want = [
        f"{name}-{i}.{domain}/{name}-{i}.{headless['metadata']['name']}.{ns}.svc.cluster.local"
        for i in range(replicas)
    ]
    if mesh != want:
        fail(f"--mesh-with {mesh} does not list the {replicas} nodes: want {want}")
    print(json.dumps({
        "args": args,
        "replicas": replicas,
        "grace": tmpl["spec"]["terminationGracePeriodSeconds"],
        "domain": domain,
    }))


def derpmap(map_path, rendered):
    info_docs = load_all(rendered)
    [sts] = by_kind(info_docs, "StatefulSet")
    replicas = sts["spec"]["replicas"]
    name = sts["metadata"]["name"]
    maps = [d.get("data", {}) for d in by_kind(info_docs, "ConfigMap")]
    domain = next(m["DERP_DOMAIN"] for m in maps if "DERP_DOMAIN" in m)
    with open(map_path) as f:
        dm = json.load(f)
    region_keys = {"RegionID", "RegionCode", "RegionName", "Latitude", "Longitude", "Avoid",
                   "NoMeasureNoHome", "Nodes"}
    node_keys = {"Name", "RegionID", "HostName", "CertName", "IPv4", "IPv6", "STUNPort",
                 "STUNOnly", "DERPPort", "InsecureForTests", "STUNTestIP", "CanPort80"}
    if set(dm) - {"Regions", "OmitDefaultRegions"}:
        fail(f"unknown DERPMap fields {set(dm) - {'Regions', 'OmitDefaultRegions'}}")
    [(rid, reg)] = dm["Regions"].items()
    if set(reg) - region_keys:
        fail(f"unknown region fields {set(reg) - region_keys}")
    if str(reg["RegionID"]) != rid:
        fail("the region's key is not its RegionID")
    nodes = reg["Nodes"]
    if len(nodes) != replicas:
        fail(f"the DERP map lists {len(nodes)} nodes, the region runs {replicas}")
    import ipaddress
    for i, n in enumerate(nodes):
        if set(n) - node_keys:
            fail(f"unknown node fields {set(n) - node_keys}")
        if n["RegionID"] != reg["RegionID"]:
            fail(f"node {n['Name']} is in another region")
        if n["HostName"] != f"{name}-{i}.{domain}":
            fail(f"node {i} is {n['HostName']}, the pod serves {name}-{i}.{domain}")
        ipaddress.IPv4Address(n["IPv4"])
        ipaddress.IPv6Address(n["IPv6"])
        for port, want in (("DERPPort", 443), ("STUNPort", 3478)):
            if n.get(port, want) != want:
                fail(f"node {n['Name']}: {port} {n[port]} is not the Service's {want}")
    if len({n["Name"] for n in nodes}) != len(nodes):
        fail("node names repeat")
    print(f"DERP map: region {rid}, {len(nodes)} nodes")


def main(argv):
    if len(argv) >= 2 and argv[0] == "crds":
        crds(argv[1:])
    elif len(argv) == 2 and argv[0] == "rule-spec":
        yaml.safe_dump({"groups": groups_of(argv[1])}, sys.stdout, sort_keys=False)
    elif len(argv) == 3 and argv[0] == "same-rules":
        a, b = groups_of(argv[1]), groups_of(argv[2])
        if a != b:
            sys.exit(f"{argv[1]} and {argv[2]} hold different rules: regenerate with render-rule")
        print("same rules")
    elif len(argv) == 2 and argv[0] == "render-rule":
        render_rule(argv[1])
    elif len(argv) == 3 and argv[0] == "region":
        region(argv[1], int(argv[2]))
    elif len(argv) == 3 and argv[0] == "derpmap":
        derpmap(argv[1], argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
