#!/usr/bin/env python3
"""Offline checks of deploy/: the Kubernetes manifests, the endpoint picker's
configuration and the Dockerfiles. Run by scripts/check-deploy.sh, which
installs what this needs into its own venv and passes the tools' locations.

What validates what:
  core resources (Deployment, Service, ConfigMap, RBAC, Namespace)
      kubernetes-validate's JSON schemas of Kubernetes' OpenAPI, strict
      variant (unknown fields fail), for --kube-version.
  Gateway, HTTPRoute (gateway.networking.k8s.io/v1)
      the schemas of the npm package @kubernetes-models/gateway-api, plus an
      unknown-field walk over its type declarations (gateway_api_schema.mjs).
  InferencePool (inference.networking.k8s.io/v1), EndpointPickerConfig
      no package ships their schemas, so INFERENCE_POOL_V1 and
      ENDPOINT_PICKER_CONFIG below restate what the Gateway API Inference
      Extension v1.3.1 defines (the InferencePool CRD's openAPIV3Schema and
      its CEL rules; the EPP's strict config decoder, its registered plugin
      types and their parameters), checked with jsonschema; metadata is
      checked against Kubernetes' ObjectMeta schema.
  how the objects fit together
      the pool selects the sipp pods and only them, its target port is the
      port sipp listens on, its endpointPickerRef reaches the EPP container's
      ext-proc port, the EPP's flags are v1.3.1's and name the three gauges
      sipp's source serves, probes, RBAC, the route and the gateway.
  the Dockerfiles
      hadolint, and what the images must be (target-cpu override, non-root
      user, port, health check, entrypoint, build context).

Then it breaks the manifests on purpose (MUTATIONS) and requires each break
to fail at least one check. It prints PASS/FAIL lines and ends with exactly
one line "N passed, M failed"; the exit status is 1 when M > 0.
"""

import argparse
import copy
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import jsonschema
import yaml

EXTENSION_VERSION = "v1.3.1"
POOL_API = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
EPP_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"

# The gauges sipp serves for the endpoint picker (crates/sipp-server/src/metrics.rs)
# and the EPP flag that names each; v1.3.1's defaults are the same names.
METRIC_FLAGS = {
    "total-queued-requests-metric": "vllm:num_requests_waiting",
    "total-running-requests-metric": "vllm:num_requests_running",
    "kv-cache-usage-percentage-metric": "vllm:kv_cache_usage_perc",
}
# Metrics v1.3.1 also reads by default, which sipp does not serve: each must be
# switched off with an empty value.
UNSERVED_METRIC_FLAGS = {
    "lora-info-metric": "vllm:lora_requests_info",
    "cache-info-metric": "vllm:cache_config_info",
}

# The EPP's command line in v1.3.1 (pkg/epp/server/options.go, plus the zap
# flags controller-runtime binds): flag -> kind of value.
EPP_FLAGS = {
    "grpc-port": "int", "ha-enable-leader-election": "bool",
    "pool-group": "str", "pool-namespace": "str", "pool-name": "str",
    "endpoint-selector": "str", "endpoint-target-ports": "ints",
    "disable-endpoint-subset-filter": "bool",
    "model-server-metrics-scheme": "str", "model-server-metrics-path": "str",
    "model-server-metrics-port": "int",
    "model-server-metrics-https-insecure-skip-verify": "bool",
    "refresh-metrics-interval": "duration",
    "refresh-prometheus-metrics-interval": "duration",
    "metrics-staleness-threshold": "duration",
    "total-queued-requests-metric": "str", "total-running-requests-metric": "str",
    "kv-cache-usage-percentage-metric": "str", "lora-info-metric": "str",
    "cache-info-metric": "str", "v": "int", "tracing": "bool",
    "health-checking": "bool", "metrics-port": "int", "grpc-health-port": "int",
    "enable-pprof": "bool", "cert-path": "str", "enable-cert-reload": "bool",
    "secure-serving": "bool", "metrics-endpoint-auth": "bool",
    "config-file": "str", "config-text": "str",
    "zap-devel": "bool", "zap-encoder": "str", "zap-log-level": "str",
    "zap-stacktrace-level": "str", "zap-time-encoding": "str",
}
EPP_DEFAULTS = {"grpc-port": 9002, "grpc-health-port": 9003, "metrics-port": 9090}

GO_DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}

# InferencePool, inference.networking.k8s.io/v1 (v1.3.1's CRD): spec only;
# metadata goes to Kubernetes' ObjectMeta schema, status is the controllers'.
INFERENCE_POOL_V1 = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": POOL_API},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": {
                                "type": "string",
                                "maxLength": 63,
                                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                            },
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": PORT},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {
                            "type": "string",
                            "maxLength": 253,
                            "pattern": r"^$|" + DNS_SUBDOMAIN[1:],
                        },
                        "kind": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def _params(properties):
    return {"type": "object", "additionalProperties": False, "properties": properties}


_PICKER_PARAMS = _params({"maxNumOfEndpoints": {"type": "integer", "minimum": 1}})
# The plugin types v1.3.1's EPP registers (cmd/epp/runner/runner.go) and the
# parameters each one decodes (None: it takes none). The data-layer plugins
# and the latency predictor are accepted with any parameters.
EPP_PLUGIN_TYPES = {
    "prefix-cache-scorer": _params({
        "autoTune": {"type": "boolean"},
        "blockSize": {"type": "integer", "minimum": 1},
        "maxPrefixBlocksToMatch": {"type": "integer", "minimum": 1},
        "lruCapacityPerServer": {"type": "integer", "minimum": 1},
    }),
    "max-score-picker": _PICKER_PARAMS,
    "random-picker": _PICKER_PARAMS,
    "weighted-random-picker": _PICKER_PARAMS,
    "single-profile-handler": None,
    "kv-cache-utilization-scorer": None,
    "queue-scorer": None,
    "running-requests-size-scorer": None,
    "lora-affinity-scorer": None,
    "predicted-latency-scorer": {"type": "object"},
    "header-based-testing-filter": None,
    "destination-endpoint-served-verifier": None,
    "metrics-data-source": {"type": "object"},
    "model-server-protocol-metrics": {"type": "object"},
}
EPP_PROFILE_HANDLERS = {"single-profile-handler"}
EPP_PICKERS = {"max-score-picker", "random-picker", "weighted-random-picker"}
EPP_FEATURE_GATES = {"dataLayer", "flowControl", "prepareDataPlugins"}

# EndpointPickerConfig (apix/config/v1alpha1 in v1.3.1), decoded strictly by
# the EPP: an unknown field anywhere is an error at start.
ENDPOINT_PICKER_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "plugins"],
    "properties": {
        "apiVersion": {"const": EPP_CONFIG_API},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": {"enum": sorted(EPP_FEATURE_GATES)}},
        "plugins": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "type": {"enum": sorted(EPP_PLUGIN_TYPES)},
                    "parameters": {},
                },
            },
        },
        "schedulingProfiles": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "plugins"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "plugins": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["pluginRef"],
                            "properties": {
                                "pluginRef": {"type": "string", "minLength": 1},
                                "weight": {"type": "integer"},
                            },
                        },
                    },
                },
            },
        },
        "saturationDetector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "queueDepthThreshold": {"type": "integer", "minimum": 0},
                "kvCacheUtilThreshold": {"type": "number", "minimum": 0, "maximum": 1},
                "metricsStalenessThreshold": {"type": "string", "pattern": GO_DURATION},
            },
        },
        "data": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "sources": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["pluginRef"],
                        "properties": {
                            "pluginRef": {"type": "string"},
                            "extractors": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["pluginRef"],
                                    "properties": {"pluginRef": {"type": "string"}},
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "images"}


def schema_errors(schema, value, where=""):
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{where}{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    ]


def label_subset(selector, labels):
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def docname(doc):
    meta = doc.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{doc.get('kind')}/{(ns + '/') if ns else ''}{meta.get('name')}"


def parse_flags(args, kinds, *, prefix="--"):
    """A pflag/clap-style command line -> ({flag: value}, [errors])."""
    flags, errors, i = {}, [], 0
    while i < len(args):
        arg = str(args[i])
        if not arg.startswith(prefix):
            errors.append(f"stray argument {arg!r}")
            i += 1
            continue
        name, eq, value = arg[len(prefix):].partition("=")
        kind = kinds.get(name)
        if kind is None:
            errors.append(f"unknown flag --{name}")
            i += 1
            continue
        if kind == "bool":
            if eq and value not in ("true", "false"):
                errors.append(f"--{name}={value}: not true/false")
            flags[name] = (value if eq else "true") == "true"
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                errors.append(f"--{name} has no value")
                break
            value = str(args[i + 1])
            i += 1
        i += 1
        if name in flags and kind != "multi":
            errors.append(f"--{name} given twice")
        if kind == "int" and not re.fullmatch(r"-?[0-9]+", value):
            errors.append(f"--{name}={value!r}: not an integer")
        elif kind == "ints" and not re.fullmatch(r"[0-9]+(,[0-9]+)*", value):
            errors.append(f"--{name}={value!r}: not a list of integers")
        elif kind == "duration" and not re.fullmatch(GO_DURATION, value):
            errors.append(f"--{name}={value!r}: not a Go duration")
        if kind == "multi":
            flags.setdefault(name, []).append(value)
        else:
            flags[name] = int(value) if kind == "int" and re.fullmatch(r"-?[0-9]+", value) else value
    return flags, errors


def sipp_serve_flags(repo):
    """`sipp serve`'s long flags from its clap definition: flag -> kind."""
    path = os.path.join(repo, "crates/sipp-cli/src/commands/serve.rs")
    kinds = {}
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    for m in re.finditer(r"#\[arg\(long(?: = \"([^\"]+)\")?[^\]]*\)\]\s*pub (\w+): ([^,\n]+),", text):
        name = m.group(1) or m.group(2).replace("_", "-")
        kinds[name] = "bool" if m.group(3).strip() == "bool" else (
            "multi" if m.group(3).startswith("Vec<") else "str")
    return kinds


def resolve_port(container, port):
    """A probe's or Service's port (number or name) -> the container port number."""
    for p in container.get("ports") or []:
        if port in (p.get("containerPort"), p.get("name")):
            return p.get("containerPort")
    return None


class Tools:
    """The validators that run outside this file, with results cached per document."""

    def __init__(self, kube_version, node, node_modules, here):
        import kubernetes_validate  # noqa: F401  (fails early when the venv lacks it)
        from kubernetes_validate import utils as kv

        self.kv = kv
        self.kube_version = kube_version
        self.node, self.node_modules, self.here = node, node_modules, here
        self.kv_cache, self.gw_cache = {}, {}
        root = os.path.join(os.path.dirname(kv.__file__), "kubernetes-json-schema")
        version = max(
            (d for d in os.listdir(root) if d.endswith("-local-strict")
             and tuple(map(int, d[1:].split("-")[0].split(".")[:2]))
             <= tuple(map(int, kube_version.split(".")[:2]))),
            key=lambda d: tuple(map(int, d[1:].split("-")[0].split("."))),
        )
        with open(os.path.join(root, version, "_definitions.json"), encoding="utf-8") as f:
            definitions = json.load(f)["$defs"]
        self.object_meta = {
            "$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
            "$defs": definitions,
        }

    def kubernetes(self, doc):
        """[errors] from Kubernetes' strict schema, or None: no schema for this kind."""
        key = json.dumps(doc, sort_keys=True)
        if key not in self.kv_cache:
            try:
                self.kv.validate(doc, self.kube_version, strict=True)
                self.kv_cache[key] = []
            except self.kv.SchemaNotFoundError:
                self.kv_cache[key] = None
            except self.kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                self.kv_cache[key] = [f"{path or '(root)'}: {e.message}"]
            except Exception as e:  # a document too broken for the schema lookup
                self.kv_cache[key] = [f"cannot validate: {e!r}"]
        return self.kv_cache[key]

    def metadata(self, doc):
        return schema_errors(self.object_meta, doc.get("metadata"), "metadata/")

    def gateway_api(self, docs):
        """{index: [errors]} for the Gateway API documents among docs."""
        todo = [d for d in docs if json.dumps(d, sort_keys=True) not in self.gw_cache]
        if todo:
            script = os.path.join(self.here, "gateway_api_schema.mjs")
            run = subprocess.run(
                [self.node, script, self.node_modules], input=json.dumps(todo),
                capture_output=True, text=True, timeout=120, check=False,
            )
            if run.returncode != 0:
                raise RuntimeError(f"gateway_api_schema.mjs failed: {run.stderr.strip()}")
            for d, r in zip(todo, json.loads(run.stdout)):
                self.gw_cache[json.dumps(d, sort_keys=True)] = r
        return {i: self.gw_cache[json.dumps(d, sort_keys=True)] for i, d in enumerate(docs)}


def load_bundle(kdir):
    """The kustomization's documents, with [(check, errors)] about the kustomization."""
    checks = []
    kpath = os.path.join(kdir, "kustomization.yaml")
    with open(kpath, encoding="utf-8") as f:
        kust = yaml.safe_load(f)
    errs = [f"unknown key {k!r}" for k in kust if k not in KUSTOMIZATION_KEYS]
    if kust.get("kind") != "Kustomization":
        errs.append("kind is not Kustomization")
    listed = kust.get("resources") or []
    on_disk = sorted(f for f in os.listdir(kdir) if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml")
    errs += [f"{r}: listed but missing" for r in listed if not os.path.isfile(os.path.join(kdir, r))]
    errs += [f"{f}: in the folder but not in resources" for f in on_disk if f not in listed]
    checks.append(("kustomization.yaml: known keys, every manifest listed and present", errs))
    docs, parse_errs = [], []
    for r in listed:
        try:
            with open(os.path.join(kdir, r), encoding="utf-8") as f:
                for doc in yaml.safe_load_all(f):
                    if doc is not None:
                        docs.append((r, doc))
        except (OSError, yaml.YAMLError) as e:
            parse_errs.append(f"{r}: {e}")
    checks.append((f"YAML parses: {len(listed)} files, {len(docs)} documents", parse_errs))
    return kust, docs, checks


def bundle_checks(kust, entries, tools, repo):
    """Every check of the manifests: [(name, [errors])]."""
    out = []
    docs = [d for _, d in entries]
    ns_default = kust.get("namespace")

    def add(name, errors):
        out.append((name, list(errors)))

    # --- identity of each object
    seen, errs = {}, []
    for f, d in entries:
        meta = d.get("metadata") or {}
        for key in ("apiVersion", "kind"):
            if not d.get(key):
                errs.append(f"{f}: no {key}")
        if not re.fullmatch(DNS_SUBDOMAIN, str(meta.get("name", ""))):
            errs.append(f"{f}: metadata.name {meta.get('name')!r} is not a DNS subdomain")
        if d.get("kind") in CLUSTER_SCOPED:
            if meta.get("namespace"):
                errs.append(f"{docname(d)}: cluster-scoped, yet has a namespace")
        elif meta.get("namespace") != ns_default:
            errs.append(f"{docname(d)}: namespace {meta.get('namespace')!r}, kustomization says {ns_default!r}")
        key = (d.get("kind"), meta.get("namespace"), meta.get("name"))
        if key in seen:
            errs.append(f"{docname(d)}: defined twice ({seen[key]} and {f})")
        seen[key] = f
    add("objects: kind, DNS names, one namespace, no duplicates", errs)

    # --- schemas
    gw = tools.gateway_api(docs)
    for i, (f, d) in enumerate(entries):
        kv = tools.kubernetes(d)
        if kv is not None:
            add(f"{docname(d)}: Kubernetes {tools.kube_version} schema, strict", kv)
        elif gw[i]["supported"]:
            add(f"{docname(d)}: Gateway API schema (@kubernetes-models/gateway-api), no unknown fields",
                gw[i]["errors"] + tools.metadata(d))
        elif d.get("apiVersion") == POOL_API and d.get("kind") == "InferencePool":
            add(f"{docname(d)}: InferencePool {POOL_API} fields ({EXTENSION_VERSION})",
                schema_errors(INFERENCE_POOL_V1, d) + tools.metadata(d) + pool_rules(d))
        else:
            add(f"{docname(d)}: a schema or checker for {d.get('apiVersion')} {d.get('kind')}",
                [f"{f}: nothing here validates this kind"])

    def find(kind, name=None, ns=None):
        return [d for d in docs if d.get("kind") == kind
                and (name is None or (d.get("metadata") or {}).get("name") == name)
                and (ns is None or (d.get("metadata") or {}).get("namespace") == ns)]

    deployments = find("Deployment")
    errs = []
    for d in deployments:
        sel = ((d.get("spec") or {}).get("selector") or {}).get("matchLabels")
        labels = (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels")
        if not label_subset(sel, labels):
            errs.append(f"{docname(d)}: selector.matchLabels {sel} not among the pod labels {labels}")
    add("Deployments: selector matches the pod template labels", errs)

    pools = find("InferencePool")
    if len(pools) != 1:
        add("exactly one InferencePool", [f"found {len(pools)}"])
        return out
    pool = pools[0]
    pspec = pool.get("spec") or {}
    pool_ns = (pool.get("metadata") or {}).get("namespace")
    pool_name = (pool.get("metadata") or {}).get("name")

    def pod_labels(d):
        return (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}

    def containers(d):
        return ((((d.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")) or []

    def pod_spec(d):
        return (((d.get("spec") or {}).get("template") or {}).get("spec")) or {}

    # --- the pool selects the sipp pods, and only them
    match = (pspec.get("selector") or {}).get("matchLabels") or {}
    selected = [d for d in deployments
                if (d.get("metadata") or {}).get("namespace") == pool_ns and label_subset(match, pod_labels(d))]
    sipp = [d for d in selected if any(c.get("name") == "sipp" for c in containers(d))]
    errs = []
    if len(selected) != 1 or len(sipp) != 1:
        errs.append(f"selector {match} selects the pods of {[docname(d) for d in selected]}; "
                    "it must select exactly the sipp Deployment's pods")
    add("InferencePool selector selects the sipp pods and no others (not the EPP's)", errs)
    if len(sipp) != 1:
        return out
    sipp_dep = sipp[0]
    sipp_c = next(c for c in containers(sipp_dep) if c.get("name") == "sipp")

    # --- sipp's command line and port
    serve_flags = sipp_serve_flags(repo)
    flags, errs = parse_flags(sipp_c.get("args") or [], serve_flags)
    if not serve_flags:
        errs.append("could not read sipp serve's flags from crates/sipp-cli/src/commands/serve.rs")
    add("sipp container: every argument is a `sipp serve` flag (from serve.rs)", errs)
    port_arg = flags.get("port")
    env = {e.get("name"): e for e in sipp_c.get("env") or []}
    if port_arg is None and "SIPP_PORT" in env:
        port_arg = env["SIPP_PORT"].get("value")
    sipp_port = int(port_arg) if port_arg is not None and str(port_arg).isdigit() else 8080
    cports = [p.get("containerPort") for p in sipp_c.get("ports") or []]
    target = [p.get("number") for p in pspec.get("targetPorts") or []]
    errs = []
    if sipp_port not in cports:
        errs.append(f"sipp listens on {sipp_port} (--port) but its container ports are {cports}")
    if not target or target[0] != sipp_port:
        errs.append(f"targetPorts {target}: the first must be sipp's port {sipp_port} "
                    "(requests and the EPP's metric scrapes go there)")
    errs += [f"targetPort {t} is not a container port of sipp ({cports})" for t in target if t not in cports]
    add("InferencePool targetPorts = sipp's --port = its containerPort", errs)

    errs = []
    if "api-key" in flags or "SIPP_API_KEY" in env:
        errs.append("sipp has an API key: its /metrics then needs one, and the EPP "
                    f"({EXTENSION_VERSION}) scrapes without credentials")
    if not flags.get("model") and "SIPP_MODEL" not in env and "config" not in flags:
        errs.append("no --model (or --config)")
    add("sipp: a model, and /metrics open to the EPP (no API key)", errs)

    ann = (((sipp_dep.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("annotations") or {}
    errs = []
    if ann.get("prometheus.io/scrape") != "true":
        errs.append("prometheus.io/scrape is not \"true\"")
    if ann.get("prometheus.io/port") != str(sipp_port):
        errs.append(f"prometheus.io/port {ann.get('prometheus.io/port')!r} is not sipp's port {sipp_port}")
    if ann.get("prometheus.io/path", "/metrics") != "/metrics":
        errs.append(f"prometheus.io/path {ann.get('prometheus.io/path')!r} is not /metrics")
    add("sipp pods: Prometheus scrape annotations name sipp's /metrics port", errs)

    errs = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = sipp_c.get(kind)
        if not probe:
            errs.append(f"no {kind}")
            continue
        http = probe.get("httpGet") or {}
        if http.get("path") != "/health":
            errs.append(f"{kind} does not GET /health")
        if resolve_port(sipp_c, http.get("port")) != sipp_port:
            errs.append(f"{kind} port {http.get('port')!r} is not sipp's port {sipp_port}")
    start = sipp_c.get("startupProbe") or {}
    budget = start.get("periodSeconds", 10) * start.get("failureThreshold", 3)
    if budget < 300:
        errs.append(f"startupProbe allows {budget}s for the model to load; give it at least 300s")
    add("sipp probes: startup/readiness/liveness on /health at sipp's port, startup >= 300s", errs)

    errs = []
    limit = str(((sipp_c.get("resources") or {}).get("limits") or {}).get("cpu", ""))
    threads = flags.get("threads")
    if threads is not None and limit.isdigit() and int(threads) > int(limit):
        errs.append(f"--threads {threads} is more than the CPU limit {limit}")
    if not (sipp_c.get("resources") or {}).get("requests"):
        errs.append("no resource requests")
    add("sipp resources: requests set, --threads within the CPU limit", errs)

    # the model: the init container fetches it into the volume sipp reads
    errs = []
    inits = pod_spec(sipp_dep).get("initContainers") or []
    fetch = [c for c in inits if "models fetch" in " ".join(map(str, (c.get("command") or []) + (c.get("args") or [])))]
    volumes = {v.get("name"): v for v in pod_spec(sipp_dep).get("volumes") or []}
    if flags.get("model") in (None, "default") and not fetch:
        errs.append("--model default with no init container running `sipp models fetch`")
    for c in fetch:
        envs = {e.get("name"): e.get("value") for e in c.get("env") or []}
        mdir = envs.get("SIPP_MODEL_DIR")
        if mdir != (env.get("SIPP_MODEL_DIR") or {}).get("value"):
            errs.append(f"{c.get('name')}: SIPP_MODEL_DIR {mdir!r} differs from sipp's")
        init_mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts") or []}
        main_mounts = {m.get("mountPath"): m.get("name") for m in sipp_c.get("volumeMounts") or []}
        if mdir not in init_mounts or init_mounts.get(mdir) != main_mounts.get(mdir):
            errs.append(f"{c.get('name')}: {mdir} is not the same volume in both containers")
        elif init_mounts[mdir] not in volumes:
            errs.append(f"volume {init_mounts[mdir]!r} is not defined")
    add("model volume: the init container fetches into the folder sipp serves from", errs)

    # --- Services
    for svc in find("Service"):
        sel = (svc.get("spec") or {}).get("selector") or {}
        errs = []
        backs = [d for d in deployments if (d.get("metadata") or {}).get("namespace") ==
                 (svc.get("metadata") or {}).get("namespace") and label_subset(sel, pod_labels(d))]
        if len(backs) != 1:
            errs.append(f"selector {sel} selects {[docname(d) for d in backs]}, not one Deployment")
        else:
            for p in (svc.get("spec") or {}).get("ports") or []:
                tp = p.get("targetPort", p.get("port"))
                if not any(resolve_port(c, tp) for c in containers(backs[0])):
                    errs.append(f"port {p.get('name')}: targetPort {tp!r} is no container port of {docname(backs[0])}")
        add(f"{docname(svc)}: selects one Deployment, every targetPort resolves", errs)

    # --- the endpoint picker
    ref = pspec.get("endpointPickerRef") or {}
    errs = []
    epp_svc = find("Service", ref.get("name"), pool_ns)
    epp_deps = []
    if ref.get("kind", "Service") != "Service" or ref.get("group", "") != "":
        errs.append("endpointPickerRef is not a core Service")
    if not epp_svc:
        errs.append(f"no Service {ref.get('name')!r} in namespace {pool_ns!r}")
    else:
        sel = (epp_svc[0].get("spec") or {}).get("selector") or {}
        epp_deps = [d for d in deployments if label_subset(sel, pod_labels(d))]
        sport = [p for p in (epp_svc[0].get("spec") or {}).get("ports") or []
                 if p.get("port") == (ref.get("port") or {}).get("number")]
        if not sport:
            errs.append(f"Service {ref.get('name')} has no port {(ref.get('port') or {}).get('number')}")
        if len(epp_deps) != 1:
            errs.append(f"Service {ref.get('name')} selects {[docname(d) for d in epp_deps]}")
    if errs or len(epp_deps) != 1:
        add("InferencePool endpointPickerRef names the EPP Service and its port", errs)
        return out
    epp_dep = epp_deps[0]
    epp_c = containers(epp_dep)[0] if containers(epp_dep) else {}
    eflags, errs = parse_flags(epp_c.get("args") or [], EPP_FLAGS)
    add(f"EPP: every argument is a {EXTENSION_VERSION} EPP flag with a valid value", errs)
    grpc = eflags.get("grpc-port", EPP_DEFAULTS["grpc-port"])
    tp = sport[0].get("targetPort", sport[0].get("port"))
    errs = []
    if resolve_port(epp_c, tp) != grpc:
        errs.append(f"Service port {sport[0].get('port')} -> targetPort {tp!r} -> "
                    f"{resolve_port(epp_c, tp)}, but the EPP serves ext-proc on --grpc-port {grpc}")
    add("InferencePool endpointPickerRef names the EPP Service and its port "
        f"({ref.get('name')}:{(ref.get('port') or {}).get('number')} -> ext-proc {grpc})", errs)

    errs = []
    if eflags.get("pool-name") != pool_name:
        errs.append(f"--pool-name {eflags.get('pool-name')!r} is not the pool {pool_name!r}")
    pns = eflags.get("pool-namespace") or (epp_dep.get("metadata") or {}).get("namespace")
    if pns != pool_ns:
        errs.append(f"--pool-namespace {pns!r} is not the pool's namespace {pool_ns!r}")
    if eflags.get("pool-group", POOL_GROUP) != POOL_GROUP:
        errs.append(f"--pool-group {eflags.get('pool-group')!r} is not {POOL_GROUP} (the v1 API)")
    if "endpoint-selector" in eflags:
        errs.append("--endpoint-selector replaces the pool; use --pool-name")
    add("EPP: --pool-name/--pool-namespace/--pool-group name the InferencePool", errs)

    errs = []
    for flag, want in METRIC_FLAGS.items():
        if eflags.get(flag) != want:
            errs.append(f"--{flag} is {eflags.get(flag)!r}, sipp serves {want!r}")
    for flag, metric in UNSERVED_METRIC_FLAGS.items():
        if eflags.get(flag, metric) != "":
            errs.append(f"--{flag} must be \"\": sipp serves no {metric}")
    if eflags.get("model-server-metrics-path", "/metrics") != "/metrics":
        errs.append(f"--model-server-metrics-path {eflags.get('model-server-metrics-path')!r} is not /metrics")
    if eflags.get("model-server-metrics-scheme", "http") != "http":
        errs.append("--model-server-metrics-scheme is not http (sipp serves plain HTTP)")
    if "model-server-metrics-port" in eflags and eflags["model-server-metrics-port"] != sipp_port:
        errs.append(f"--model-server-metrics-port {eflags['model-server-metrics-port']} is not sipp's port")
    add("EPP metric flags: " + ", ".join(METRIC_FLAGS.values()) + " (lora/cache info off)", errs)

    src = os.path.join(repo, "crates/sipp-server/src/metrics.rs")
    errs = []
    if os.path.exists(src):
        text = open(src, encoding="utf-8").read()
        errs += [f"{src}: does not serve {m}" for m in METRIC_FLAGS.values() if f'"{m}"' not in text]
        errs += [f"{src}: serves {m}; enable its flag" for m in UNSERVED_METRIC_FLAGS.values() if f'"{m}"' in text]
        if '"model_name"' not in text:
            errs.append(f"{src}: no model_name label")
    else:
        errs.append(f"{src} not found")
    add("sipp's source serves the gauges the EPP is told to read", errs)

    errs = []
    cport = {p.get("containerPort") for p in epp_c.get("ports") or []}
    for flag in ("grpc-port", "grpc-health-port", "metrics-port"):
        if eflags.get(flag, EPP_DEFAULTS[flag]) not in cport:
            errs.append(f"--{flag} {eflags.get(flag, EPP_DEFAULTS[flag])} is not a container port")
    hport = eflags.get("grpc-health-port", EPP_DEFAULTS["grpc-health-port"])
    for kind in ("livenessProbe", "readinessProbe"):
        probe = (epp_c.get(kind) or {}).get("grpc") or {}
        if probe.get("port") != hport:
            errs.append(f"{kind}: no gRPC check on --grpc-health-port {hport}")
    envs = {e.get("name"): e for e in epp_c.get("env") or []}
    for name, path in (("NAMESPACE", "metadata.namespace"), ("POD_NAME", "metadata.name")):
        if ((envs.get(name) or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") != path:
            errs.append(f"env {name} is not the downward API's {path}")
    replicas = (epp_dep.get("spec") or {}).get("replicas", 1)
    if replicas != 1 and not eflags.get("ha-enable-leader-election"):
        errs.append(f"{replicas} replicas without --ha-enable-leader-election")
    add("EPP: container ports, gRPC health probes, NAMESPACE/POD_NAME, one active replica", errs)

    # the EPP's configuration file
    errs, cfg = [], None
    if ("config-file" in eflags) == ("config-text" in eflags):
        errs.append("exactly one of --config-file and --config-text must be set")
    elif "config-text" in eflags:
        cfg = eflags["config-text"]
    else:
        path = eflags["config-file"]
        mounts = [m for m in epp_c.get("volumeMounts") or [] if path.startswith(m.get("mountPath", "").rstrip("/") + "/")]
        vols = {v.get("name"): v for v in pod_spec(epp_dep).get("volumes") or []}
        if not mounts:
            errs.append(f"--config-file {path}: no volume mounted there")
        else:
            vol = vols.get(mounts[0].get("name")) or {}
            cm_name = (vol.get("configMap") or {}).get("name")
            key = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
            cms = find("ConfigMap", cm_name, (epp_dep.get("metadata") or {}).get("namespace"))
            if not cms:
                errs.append(f"--config-file {path}: volume {mounts[0].get('name')!r} is no ConfigMap of this bundle")
            elif key not in (cms[0].get("data") or {}):
                errs.append(f"ConfigMap {cm_name} has no key {key!r}")
            else:
                cfg = cms[0]["data"][key]
    add("EPP: --config-file is a key of the mounted ConfigMap", errs)
    if cfg is not None:
        add(f"EndpointPickerConfig {EPP_CONFIG_API}: strict fields, registered plugins ({EXTENSION_VERSION})",
            epp_config_errors(cfg))

    # RBAC
    errs = []
    sa = pod_spec(epp_dep).get("serviceAccountName")
    epp_ns = (epp_dep.get("metadata") or {}).get("namespace")
    if not find("ServiceAccount", sa, epp_ns):
        errs.append(f"serviceAccountName {sa!r}: no such ServiceAccount")
    needs = [("", "pods"), (POOL_GROUP, "inferencepools")]
    granted = set()
    for rb in find("RoleBinding", ns=epp_ns):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace", epp_ns) == epp_ns
                   for s in rb.get("subjects") or []):
            continue
        role_ref = rb.get("roleRef") or {}
        for role in find(role_ref.get("kind", ""), role_ref.get("name"), epp_ns if role_ref.get("kind") == "Role" else None):
            for rule in role.get("rules") or []:
                for g in rule.get("apiGroups") or []:
                    for r in rule.get("resources") or []:
                        for v in rule.get("verbs") or []:
                            granted.add((g, r, v))
    for group, resource in needs:
        for verb in ("get", "list", "watch"):
            if (group, resource, verb) not in granted:
                errs.append(f"the EPP may not {verb} {resource} ({group or 'core'}) in {epp_ns}")
    if eflags.get("metrics-endpoint-auth", True):
        cgrant = set()
        for crb in find("ClusterRoleBinding"):
            if any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace") == epp_ns
                   for s in crb.get("subjects") or []):
                for role in find("ClusterRole", (crb.get("roleRef") or {}).get("name")):
                    for rule in role.get("rules") or []:
                        cgrant |= {(r, v) for r in rule.get("resources") or [] for v in rule.get("verbs") or []}
        for r in ("tokenreviews", "subjectaccessreviews"):
            if (r, "create") not in cgrant:
                errs.append(f"--metrics-endpoint-auth is on but the EPP may not create {r}")
    add("EPP RBAC: its ServiceAccount may watch pods and InferencePools (and review tokens)", errs)

    # --- Gateway and HTTPRoute
    errs = []
    routes = find("HTTPRoute")
    if not routes:
        errs.append("no HTTPRoute")
    for route in routes:
        rns = (route.get("metadata") or {}).get("namespace")
        spec = route.get("spec") or {}
        for pr in spec.get("parentRefs") or []:
            if pr.get("kind", "Gateway") != "Gateway" or pr.get("group", "gateway.networking.k8s.io") != "gateway.networking.k8s.io":
                errs.append(f"{docname(route)}: parentRef {pr} is not a Gateway")
                continue
            gws = find("Gateway", pr.get("name"), pr.get("namespace", rns))
            if not gws:
                errs.append(f"{docname(route)}: no Gateway {pr.get('name')!r}")
                continue
            ok = False
            for ln in (gws[0].get("spec") or {}).get("listeners") or []:
                if pr.get("sectionName") not in (None, ln.get("name")):
                    continue
                frm = (((ln.get("allowedRoutes") or {}).get("namespaces") or {}).get("from")) or "Same"
                same = (gws[0].get("metadata") or {}).get("namespace") == rns
                if ln.get("protocol") in ("HTTP", "HTTPS") and (frm == "All" or (frm == "Same" and same)):
                    ok = True
            if not ok:
                errs.append(f"{docname(route)}: no HTTP listener of Gateway {pr.get('name')} admits it")
        to_pool = False
        for rule in spec.get("rules") or []:
            for br in rule.get("backendRefs") or []:
                if br.get("kind") == "InferencePool" or br.get("group") == POOL_GROUP:
                    if br.get("group") != POOL_GROUP or br.get("kind") != "InferencePool":
                        errs.append(f"{docname(route)}: backendRef {br} must be group {POOL_GROUP}, kind InferencePool")
                    elif not find("InferencePool", br.get("name"), br.get("namespace", rns)):
                        errs.append(f"{docname(route)}: no InferencePool {br.get('name')!r}")
                    else:
                        to_pool = True
                    if "port" in br:
                        errs.append(f"{docname(route)}: an InferencePool backendRef takes no port")
                else:
                    errs.append(f"{docname(route)}: backendRef {br} bypasses the InferencePool")
        if not to_pool:
            errs.append(f"{docname(route)}: no rule sends traffic to the InferencePool")
    add("HTTPRoute: attached to the Gateway's HTTP listener, backend is the InferencePool", errs)

    # --- the image the kustomization rewrites is one the containers use
    errs = []
    used = {str(c.get("image", "")).split(":")[0] for d in deployments
            for c in containers(d) + (pod_spec(d).get("initContainers") or [])}
    for img in kust.get("images") or []:
        if img.get("name") not in used:
            errs.append(f"images: {img.get('name')!r} is used by no container")
    add("kustomization images: each names an image the containers use", errs)
    return out


def pool_rules(pool):
    """The InferencePool CRD's CEL rules."""
    spec = pool.get("spec") or {}
    errs = []
    nums = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if len(nums) != len(set(nums)):
        errs.append("spec/targetPorts: port number must be unique")
    ref = spec.get("endpointPickerRef") or {}
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errs.append("spec/endpointPickerRef: port is required when kind is 'Service' or unspecified")
    return errs


def epp_config_errors(text):
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"not YAML: {e}"]
    if not isinstance(cfg, dict):
        return ["not a mapping"]
    errs = schema_errors(ENDPOINT_PICKER_CONFIG, cfg)
    if errs:
        return errs
    names, types = [], {}
    for i, p in enumerate(cfg.get("plugins") or []):
        name = p.get("name") or p["type"]  # the EPP names a plugin after its type
        names.append(name)
        types[name] = p["type"]
        params_schema = EPP_PLUGIN_TYPES[p["type"]]
        if params_schema is None:
            if p.get("parameters") not in (None, {}):
                errs.append(f"plugins/{i}: {p['type']} takes no parameters")
        else:
            errs += schema_errors(params_schema, p.get("parameters") or {}, f"plugins/{i}/parameters/")
    errs += [f"plugin name {n!r} used twice" for n in sorted(set(names)) if names.count(n) > 1]
    profiles = cfg.get("schedulingProfiles") or []
    pnames = [p["name"] for p in profiles]
    errs += [f"profile {n!r} defined twice" for n in sorted(set(pnames)) if pnames.count(n) > 1]
    used = set()
    for prof in profiles:
        for j, ref in enumerate(prof["plugins"]):
            if ref["pluginRef"] not in types:
                errs.append(f"schedulingProfiles[{prof['name']}].plugins[{j}]: undefined plugin {ref['pluginRef']!r}")
            used.add(ref["pluginRef"])
            if "weight" in ref and types.get(ref["pluginRef"]) in EPP_PICKERS | EPP_PROFILE_HANDLERS:
                errs.append(f"schedulingProfiles[{prof['name']}]: {ref['pluginRef']} is no scorer, it takes no weight")
    if len(profiles) > 1 and not any(t in EPP_PROFILE_HANDLERS for t in types.values()):
        errs.append("several profiles need a profile handler plugin")
    for name, t in types.items():
        if t not in EPP_PROFILE_HANDLERS and name not in used and not t.startswith(("metrics-", "model-server-")):
            errs.append(f"plugin {name!r} is defined but no profile uses it")
    for src in (cfg.get("data") or {}).get("sources") or []:
        for ref in [src["pluginRef"]] + [e["pluginRef"] for e in src.get("extractors") or []]:
            if ref not in types:
                errs.append(f"data: undefined plugin {ref!r}")
    return errs


# --- Dockerfiles


def dockerfile_instructions(text):
    """[(INSTRUCTION, text)] with continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_checks(repo, hadolint, texts=None):
    """Checks of both Dockerfiles; texts: {relative path: text} replaces files (mutations)."""
    out = []
    texts = texts or {}
    expect = {
        "deploy/Dockerfile": {"builder": r"^rust:\$\{RUST_VERSION\}-\$\{DEBIAN_SUITE\}",
                              "runtime": r"^debian:\$\{DEBIAN_SUITE\}-slim", "features": None},
        "deploy/Dockerfile.cuda": {"builder": r"^nvidia/cuda:\$\{CUDA_VERSION\}-devel-",
                                   "runtime": r"^nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", "features": "cuda"},
    }
    for rel, want in expect.items():
        path = os.path.join(repo, rel)
        if rel in texts:
            text = texts[rel]
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        if hadolint:
            run = subprocess.run([hadolint, "--no-color", "-"], input=text, capture_output=True,
                                 text=True, check=False)
            out.append((f"{rel}: hadolint", [] if run.returncode == 0 else
                        (run.stdout + run.stderr).strip().splitlines()))
        instr = dockerfile_instructions(text)
        errs = []
        args = {}
        for k, v in instr:
            if k == "ARG":
                name, _, val = v.partition("=")
                args[name] = val.strip('"')
        stages, cur = {}, None
        for k, v in instr:
            if k == "FROM":
                parts = v.split()
                cur = parts[-1] if len(parts) >= 3 and parts[-2].upper() == "AS" else parts[0]
                stages[cur] = {"from": parts[0], "ins": []}
            elif cur:
                stages[cur]["ins"].append((k, v))
        if "builder" not in stages or not re.match(want["builder"], stages["builder"]["from"]):
            errs.append(f"no builder stage FROM {want['builder']}")
        final = list(stages)[-1] if stages else None
        if final != "runtime" or not re.match(want["runtime"], stages["runtime"]["from"]):
            errs.append(f"the last stage must be `runtime` FROM {want['runtime']}")
        b = " ".join(f"{k} {v}" for k, v in stages.get("builder", {}).get("ins", []))
        for pkg in ("cmake", "libclang-dev", "g++"):
            if not re.search(rf"apt-get install[^&]*\s{re.escape(pkg)}(\s|$)", b):
                errs.append(f"builder does not install {pkg}")
        cpu = args.get("TARGET_CPU", "")
        if "target-cpu=${TARGET_CPU}" not in b or not cpu or cpu == "native":
            errs.append(f"RUSTFLAGS must override .cargo/config.toml's target-cpu=native (TARGET_CPU={cpu!r})")
        m = re.search(r"cargo build ([^&]*)", b)
        cmd = shlex.split(m.group(1)) if m else []
        for need in ("--release", "--locked"):
            if need not in cmd:
                errs.append(f"cargo build without {need}")
        if "-p" not in cmd or cmd[cmd.index("-p") + 1] != "sipp-cli" or "--bin" not in cmd or cmd[cmd.index("--bin") + 1] != "sipp":
            errs.append("cargo build must build -p sipp-cli --bin sipp")
        if want["features"]:
            feats = cmd[cmd.index("--features") + 1] if "--features" in cmd else ""
            feats = re.sub(r"\$\{(\w+)\}", lambda mm: args.get(mm.group(1), ""), feats)
            if want["features"] not in re.split(r"[ ,]", feats):
                errs.append(f"cargo build must pass --features {want['features']} (got {feats!r})")
            # The feature must exist on sipp-cli and reach llama-cpp-2.
            with open(os.path.join(repo, "crates/sipp-cli/Cargo.toml"), encoding="utf-8") as f:
                cli_toml = f.read()
            if not re.search(rf'^{re.escape(want["features"])}\s*=\s*\[[^\]]*"sipp-rs/{re.escape(want["features"])}"',
                             cli_toml, re.M):
                errs.append(f"sipp-cli has no feature `{want['features']}` passing sipp-rs/{want['features']}")
            arch = args.get("CMAKE_CUDA_ARCHITECTURES", "")
            if not arch or "CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES}" not in b:
                errs.append("ARG CMAKE_CUDA_ARCHITECTURES must have a default and reach cargo's environment")
        elif "--features" in cmd:
            errs.append("the CPU image builds default features only")
        r_ins = stages.get("runtime", {}).get("ins", [])
        r = " ".join(f"{k} {v}" for k, v in r_ins)
        for pkg in ("ca-certificates", "libgomp1"):
            if not re.search(rf"\s{re.escape(pkg)}(\s|$)", r):
                errs.append(f"runtime does not install {pkg}")
        users = [v for k, v in r_ins if k == "USER"]
        if not users or users[-1].split(":")[0] in ("0", "root"):
            errs.append("runtime must run as a non-root USER")
        if "8080" not in [v for k, v in r_ins if k == "EXPOSE"]:
            errs.append("runtime must EXPOSE 8080")
        hc = [v for k, v in r_ins if k == "HEALTHCHECK"]
        if not hc or "/health" not in hc[-1]:
            errs.append("no HEALTHCHECK on /health")
        ep = [v for k, v in r_ins if k == "ENTRYPOINT"]
        if not ep or json.loads(ep[-1]) != ["sipp", "serve", "--host", "0.0.0.0"]:
            errs.append('ENTRYPOINT must be ["sipp", "serve", "--host", "0.0.0.0"]')
        if not any(k == "COPY" and "--from=builder" in v and v.split()[-1] == "/usr/local/bin/sipp" for k, v in r_ins):
            errs.append("runtime does not COPY sipp from the builder to /usr/local/bin/sipp")
        out.append((f"{rel}: builder, target-cpu override, cargo invocation, non-root runtime, "
                    "port, health check, entrypoint", errs))

        # the build context: the Dockerfile's own ignore file
        ign = path + ".dockerignore"
        errs = []
        if not os.path.exists(ign):
            errs.append(f"{rel}.dockerignore is missing (the context would carry target/ and .git)")
        else:
            pats = [ln.strip() for ln in open(ign, encoding="utf-8") if ln.strip() and not ln.startswith("#")]
            def ignored(p):
                return any(not pt.startswith("!") and (fnmatch.fnmatch(p, pt) or p.startswith(pt.rstrip("/") + "/")) for pt in pats)
            for p in ("target", ".git"):
                if not ignored(p):
                    errs.append(f"{p} is not ignored")
            for p in ("Cargo.toml", "Cargo.lock", ".cargo/config.toml", "crates/sipp/src/lib.rs",
                      "crates/sipp-server/web/index.html", "crates/sipp/examples/grammar_engines.rs"):
                if ignored(p):
                    errs.append(f"{p} is ignored but the build needs it")
        out.append((f"{rel}.dockerignore: keeps target/ and .git out, the workspace in", errs))
    return out


def cross_image_checks(repo, entries):
    """The Kubernetes pods and the image agree on user, port and model folder."""
    errs = []
    with open(os.path.join(repo, "deploy/Dockerfile"), encoding="utf-8") as f:
        dockerfile = dockerfile_instructions(f.read())
    user = [v for k, v in dockerfile if k == "USER"][-1].split(":")[0]
    envs = " ".join(v for k, v in dockerfile if k == "ENV")
    for _, d in entries:
        if d.get("kind") != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if not str(c.get("image", "")).startswith("sipp"):
                continue
            uid = str(((c.get("securityContext") or {}).get("runAsUser")) or (spec.get("securityContext") or {}).get("runAsUser"))
            if uid != user:
                errs.append(f"{c['name']}: runAsUser {uid} but the image's USER is {user}")
            for e in c.get("env") or []:
                if e.get("name") == "SIPP_MODEL_DIR" and f"SIPP_MODEL_DIR={e.get('value')}" not in envs:
                    errs.append(f"{c['name']}: SIPP_MODEL_DIR={e.get('value')} differs from the image's")
    return [("sipp pods and deploy/Dockerfile agree on user and model folder", errs)]


# --- the checker must catch real mistakes


def _doc(entries, kind, name):
    return next(d for _, d in entries if d.get("kind") == kind and d["metadata"]["name"] == name)


def _args(entries, dep):
    return _doc(entries, "Deployment", dep)["spec"]["template"]["spec"]["containers"][0]["args"]


def _set_flag(entries, flag, value):
    args = _args(entries, "sipp-epp")
    args[args.index(flag) + 1] = value


def _cm(entries, edit):
    cm = _doc(entries, "ConfigMap", "sipp-epp-config")
    cm["data"]["epp-config.yaml"] = edit(cm["data"]["epp-config.yaml"])


MUTATIONS = [
    ("InferencePool targetPorts 8080 -> 8081",
     lambda e: _doc(e, "InferencePool", "sipp")["spec"]["targetPorts"][0].update(number=8081)),
    ("InferencePool field misspelled: endpointPickerRef -> endpointPickerRefs",
     lambda e: _doc(e, "InferencePool", "sipp")["spec"].update(
         endpointPickerRefs=_doc(e, "InferencePool", "sipp")["spec"].pop("endpointPickerRef"))),
    ("InferencePool selector label value typo",
     lambda e: _doc(e, "InferencePool", "sipp")["spec"]["selector"]["matchLabels"].update(
         {"app.kubernetes.io/component": "model-sever"})),
    ("endpointPickerRef port 9002 -> 9090 (the EPP's metrics port)",
     lambda e: _doc(e, "InferencePool", "sipp")["spec"]["endpointPickerRef"]["port"].update(number=9090)),
    ("EPP reads vLLM's old KV gauge vllm:gpu_cache_usage_perc",
     lambda e: _set_flag(e, "--kv-cache-usage-percentage-metric", "vllm:gpu_cache_usage_perc")),
    ("EPP flag misspelled: --total-queued-request-metric",
     lambda e: _args(e, "sipp-epp").__setitem__(
         _args(e, "sipp-epp").index("--total-queued-requests-metric"), "--total-queued-request-metric")),
    ("EPP --pool-name names another pool",
     lambda e: _set_flag(e, "--pool-name", "sipp-pool")),
    ("EndpointPickerConfig pluginRef typo queue-scorrer",
     lambda e: _cm(e, lambda t: t.replace("pluginRef: queue-scorer", "pluginRef: queue-scorrer"))),
    ("EndpointPickerConfig field misspelled: schedulingProfile",
     lambda e: _cm(e, lambda t: t.replace("schedulingProfiles:", "schedulingProfile:"))),
    ("EndpointPickerConfig prefix-cache-scorer parameter typo blocksize",
     lambda e: _cm(e, lambda t: t.replace("blockSize:", "blocksize:"))),
    ("sipp Service targetPort names no container port",
     lambda e: _doc(e, "Service", "sipp")["spec"]["ports"][0].update(targetPort="htp")),
    ("sipp container field misspelled: containerPort -> containerPorts",
     lambda e: _doc(e, "Deployment", "sipp")["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
         containerPorts=_doc(e, "Deployment", "sipp")["spec"]["template"]["spec"]["containers"][0]["ports"][0].pop("containerPort"))),
    ("sipp replicas as a string",
     lambda e: _doc(e, "Deployment", "sipp")["spec"].update(replicas="2")),
    ("sipp given an API key (the EPP could not scrape /metrics)",
     lambda e: _args(e, "sipp").extend(["--api-key", "sk-test"])),
    ("sipp readiness probe on /healthz",
     lambda e: _doc(e, "Deployment", "sipp")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(path="/healthz")),
    ("HTTPRoute backendRef kind InferencePools",
     lambda e: _doc(e, "HTTPRoute", "sipp")["spec"]["rules"][0]["backendRefs"][0].update(kind="InferencePools")),
    ("HTTPRoute field misspelled: backendRefs -> backendRef",
     lambda e: _doc(e, "HTTPRoute", "sipp")["spec"]["rules"][0].update(
         backendRef=_doc(e, "HTTPRoute", "sipp")["spec"]["rules"][0].pop("backendRefs"))),
    ("Gateway listener protocol misspelled",
     lambda e: _doc(e, "Gateway", "inference-gateway")["spec"]["listeners"][0].update(protocol="HTTTP")),
    ("EPP Role loses watch on pods",
     lambda e: _doc(e, "Role", "sipp-epp")["rules"][2].update(verbs=["get", "list"])),
]


DOCKERFILE_MUTATIONS = [
    ("deploy/Dockerfile builds for target-cpu=native",
     "deploy/Dockerfile", lambda t: t.replace("ARG TARGET_CPU=x86-64-v2", "ARG TARGET_CPU=native")),
    ("deploy/Dockerfile runs as root",
     "deploy/Dockerfile", lambda t: t.replace("USER 10001:10001", "USER root")),
    ("deploy/Dockerfile without libgomp1",
     "deploy/Dockerfile", lambda t: t.replace(" libgomp1 ", " ")),
    ("deploy/Dockerfile.cuda without --features",
     "deploy/Dockerfile.cuda", lambda t: t.replace(' --features "${CARGO_FEATURES}"', "")),
    ("deploy/Dockerfile.cuda: CMAKE_CUDA_ARCHITECTURES never reaches cargo",
     "deploy/Dockerfile.cuda", lambda t: t.replace(
         "    CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES} \\\n", "")),
    ("deploy/Dockerfile: apt-get install without --no-install-recommends (hadolint DL3015)",
     "deploy/Dockerfile", lambda t: t.replace("install -y --no-install-recommends cmake", "install -y cmake")),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--kube-version", default="1.33.0")
    ap.add_argument("--node", required=True, help="the node binary")
    ap.add_argument("--node-modules", required=True, help="where @kubernetes-models/gateway-api is installed")
    ap.add_argument("--hadolint", default=shutil.which("hadolint"))
    ap.add_argument("--kubectl", default=shutil.which("kubectl"),
                    help="optional: compare with `kubectl kustomize`'s rendering")
    opts = ap.parse_args()
    repo = os.path.abspath(opts.repo)
    here = os.path.dirname(os.path.abspath(__file__))
    kdir = os.path.join(repo, "deploy", "kubernetes")
    tools = Tools(opts.kube_version, opts.node, opts.node_modules, here)

    passed = failed = 0

    def report(name, errors):
        nonlocal passed, failed
        if errors:
            failed += 1
            print(f"FAIL {name}")
            for e in errors:
                print(f"       {e}")
        else:
            passed += 1
            print(f"PASS {name}")

    print(f"== deploy/kubernetes (Kubernetes {opts.kube_version}, "
          f"Gateway API Inference Extension {EXTENSION_VERSION})")
    kust, entries, checks = load_bundle(kdir)
    for name, errs in checks:
        report(name, errs)
    baseline = bundle_checks(kust, entries, tools, repo)
    for name, errs in baseline:
        report(name, errs)
    for name, errs in cross_image_checks(repo, entries):
        report(name, errs)

    if opts.kubectl:
        run = subprocess.run([opts.kubectl, "kustomize", kdir], capture_output=True, text=True, check=False)
        errs = [] if run.returncode == 0 else [run.stderr.strip()]
        if not errs:
            rendered = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
                        for d in yaml.safe_load_all(run.stdout) if d}
            mine = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for _, d in entries}
            errs += [f"kustomize renders {k} that was not checked" for k in sorted(rendered - mine, key=str)]
            errs += [f"checked {k} that kustomize does not render" for k in sorted(mine - rendered, key=str)]
        report("`kubectl kustomize` renders exactly the objects checked", errs)
    else:
        print("SKIP `kubectl kustomize` comparison (no kubectl)")

    print("== deploy/Dockerfile, deploy/Dockerfile.cuda"
          + ("" if opts.hadolint else " (SKIP hadolint: not installed)"))
    for name, errs in dockerfile_checks(repo, opts.hadolint):
        report(name, errs)
    readme = os.path.join(repo, "deploy", "README.md")
    text = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""
    report("deploy/README.md: the build command and the extension version",
           [s for s in ("docker build -f deploy/Dockerfile .", EXTENSION_VERSION) if s not in text])

    print("== mutations: each deliberate mistake must fail a check")
    if any(errs for _, errs in baseline):
        report("mutations (need a clean baseline)", ["the manifests fail already; fix them first"])
    else:
        for name, mutate in MUTATIONS:
            broken = copy.deepcopy(entries)
            mutate(broken)
            if broken == entries:
                report(f"caught: {name}", ["the mutation changed nothing: update it"])
                continue
            caught = [n for n, errs in bundle_checks(kust, broken, tools, repo) if errs]
            report(f"caught: {name}" + (f"  [by: {caught[0]}]" if caught else ""),
                   [] if caught else ["no check failed"])

        for name, rel, mutate in DOCKERFILE_MUTATIONS:
            with open(os.path.join(repo, rel), encoding="utf-8") as f:
                text = f.read()
            broken = mutate(text)
            if broken == text:
                report(f"caught: {name}", ["the mutation changed nothing: update it"])
                continue
            caught = [n for n, errs in dockerfile_checks(repo, opts.hadolint, {rel: broken})
                      if errs and n.startswith(rel + ":")]
            report(f"caught: {name}" + (f"  [by: {caught[0]}]" if caught else ""),
                   [] if caught else ["no check failed"])

    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
