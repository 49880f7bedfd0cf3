"""deploy/kuberay/: the RayCluster and RayJob validate against KubeRay's own CRD schemas, the
Redis StatefulSet/Service and the run-directory claim against Kubernetes' OpenAPI definitions
(all committed under fixtures/schemas, see its README), and the facts the files share hold:
GPU limits equal Ray's num-gpus, groups are sized for a real config, the RayJob trains a config
shipped in the image against the Redis of redis.yaml, images are the Dockerfiles' tags."""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from functools import cache
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from tests.test_deploy_images import (ROOT, SCHEMAS, build_tag, compose, dockerfile, image_tag, instructions,
                                      lock_pins, workdir)

KUBERAY = ROOT / "deploy" / "kuberay"
# Kubernetes resource.Quantity (the pattern the CRDs carry for resources.limits/requests).
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d is not None]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in docs(name) if d["kind"] == kind]
    return doc


def quantity(value: str | int | float) -> float:
    m = re.fullmatch(r"([0-9.eE+-]+?)([numkMGTPE]i?|)", str(value))
    return float(m.group(1)) * SUFFIX[m.group(2)]


# --- schemas ---------------------------------------------------------------------------------

def _structural(node, strict: bool = True):
    """A CRD's openAPIV3Schema as a JSON-schema validator reads it, with the apiserver's rules:
    ``nullable`` admits null; ``x-kubernetes-int-or-string`` is integer or string; an object
    with declared properties takes no others (kubectl's default --validate=strict rejects
    unknown fields) unless ``x-kubernetes-preserve-unknown-fields``. CEL rules
    (``x-kubernetes-validations``) are not evaluated: test_manifests_set_no_field_with_cel_rules."""
    if isinstance(node, list):
        return [_structural(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_structural(v, strict) if k not in ("properties", "enum", "default") else v) for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {k: _structural(v, strict) for k, v in node["properties"].items()}
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (strict and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / f"kuberay-{kind.lower()}-v1.json").read_text())
    return jsonschema.Draft7Validator(_structural(schema))


@cache
def k8s_definitions() -> dict:
    """Kubernetes' OpenAPI v2 definitions, read as kubeconform's "strict" schemas are: no
    unknown fields; IntOrString and Quantity take the YAML scalars the apiserver accepts."""
    defs = json.loads((SCHEMAS / "k8s-definitions.json").read_text())["definitions"]
    defs = {name: _structural(d) for name, d in defs.items()}
    defs["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    defs["io.k8s.apimachinery.pkg.api.resource.Quantity"] = {
        "anyOf": [{"type": "number"}, {"type": "string", "pattern": QUANTITY}]}
    return defs


def k8s_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    defs = k8s_definitions()
    group, _, version = api_version.rpartition("/")
    names = [n for n, d in defs.items()
             if {"group": group, "version": version, "kind": kind} in d.get("x-kubernetes-group-version-kind", [])]
    assert len(names) == 1, f"no committed Kubernetes schema for {api_version} {kind}"
    return jsonschema.Draft7Validator({"$ref": f"#/definitions/{names[0]}", "definitions": defs})


def meta_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator({"$ref": "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
                                       "definitions": k8s_definitions()})


def errors(validator: jsonschema.Draft7Validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


@pytest.mark.parametrize(("name", "kind"), [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_kuberay_manifests_match_the_crd_schemas(name, kind) -> None:
    (doc,) = docs(name)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", kind)
    assert errors(crd_validator(kind), doc) == []
    assert errors(meta_validator(), doc["metadata"]) == []  # the CRD schema leaves metadata to the apiserver
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])  # a DNS label: names Services


@pytest.mark.parametrize("name", ["redis.yaml", "storage.yaml"])
def test_kubernetes_manifests_match_the_api_schemas(name) -> None:
    for doc in docs(name):
        assert errors(k8s_validator(doc["apiVersion"], doc["kind"]), doc) == [], doc["kind"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])  # DNS-1035: Service names


def test_schemas_reject_the_mistakes_they_should() -> None:
    """Negative controls: the validators are strict about names, types and quantities."""
    (cluster,) = docs("raycluster.yaml")
    group = cluster["spec"]["workerGroupSpecs"][0]
    for mutate in (lambda g: g.__setitem__("rayStartParam", g.pop("rayStartParams")),   # unknown field
                   lambda g: g.__setitem__("replicas", "one"),                          # wrong type
                   lambda g: g["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("cpu", "2 cores"),
                   lambda g: g.pop("groupName")):                                       # required
        bad = copy.deepcopy(cluster)
        mutate(bad["spec"]["workerGroupSpecs"][cluster["spec"]["workerGroupSpecs"].index(group)])
        assert errors(crd_validator("RayCluster"), bad), mutate
    (job,) = docs("rayjob.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["shutdownAfterJobFinish"] = bad["spec"].pop("shutdownAfterJobFinishes")
    assert errors(crd_validator("RayJob"), bad)
    sts = one("redis.yaml", "StatefulSet")
    for mutate in (lambda s: s["spec"].__setitem__("volumeClaimTemplate", s["spec"].pop("volumeClaimTemplates")),
                   lambda s: s["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("memory", "2 GB"),
                   lambda s: s["spec"]["template"]["spec"]["containers"][0].pop("name")):
        bad = copy.deepcopy(sts)
        mutate(bad)
        assert errors(k8s_validator("apps/v1", "StatefulSet"), bad)
    svc = one("redis.yaml", "Service")
    bad = copy.deepcopy(svc)
    bad["spec"]["ports"][0]["port"] = "6379"
    assert errors(k8s_validator("v1", "Service"), bad)
    assert errors(meta_validator(), {"name": "x", "labels": {"a": 1}})


def _paths_with_cel(node, path=()) -> set[tuple]:
    found = {path} if isinstance(node, dict) and "x-kubernetes-validations" in node else set()
    if isinstance(node, dict):
        for key, child in node.get("properties", {}).items():
            found |= _paths_with_cel(child, (*path, key))
        if isinstance(node.get("items"), dict):
            found |= _paths_with_cel(node["items"], (*path, "*"))
    return found


def _has_path(doc, path: tuple) -> bool:
    if not path:
        return True
    if path[0] == "*":
        return isinstance(doc, list) and any(_has_path(d, path[1:]) for d in doc)
    return isinstance(doc, dict) and path[0] in doc and _has_path(doc[path[0]], path[1:])


@pytest.mark.parametrize(("name", "kind"), [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_manifests_set_no_field_with_cel_rules(name, kind) -> None:
    """JSON schema cannot evaluate the CRDs' CEL rules; these manifests stay clear of them."""
    schema = json.loads((SCHEMAS / f"kuberay-{kind.lower()}-v1.json").read_text())
    cel = _paths_with_cel(schema)
    assert cel, "the schema has CEL rules (managedBy, ...): the walk must find them"
    (doc,) = docs(name)
    assert [p for p in cel if _has_path(doc, p)] == []


# --- what the files share ------------------------------------------------------------------------

def cluster_specs() -> dict[str, dict]:
    (cluster,) = docs("raycluster.yaml")
    (job,) = docs("rayjob.yaml")
    return {"raycluster.yaml": cluster["spec"], "rayjob.yaml": job["spec"]["rayClusterSpec"]}


def groups(spec: dict) -> list[tuple[str, dict]]:
    """(name, group) for the head ("head") and every worker group."""
    return [("head", spec["headGroupSpec"]), *((g["groupName"], g) for g in spec["workerGroupSpecs"])]


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def ray_resources(group: dict) -> tuple[float, float]:
    """(Ray CPUs, Ray GPUs) one pod of the group advertises: rayStartParams, else the limits
    (what KubeRay passes to `ray start` when the params are absent)."""
    params, limits = group.get("rayStartParams", {}), container(group)["resources"]["limits"]
    cpus = float(params["num-cpus"]) if "num-cpus" in params else quantity(limits["cpu"])
    gpus = float(params["num-gpus"]) if "num-gpus" in params else quantity(limits.get("nvidia.com/gpu", 0))
    return cpus, gpus


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_gpu_limits_equal_ray_num_gpus_and_cpus_match(name) -> None:
    spec = cluster_specs()[name]
    for group_name, group in groups(spec):
        res = container(group)["resources"]
        gpu_limit = quantity(res["limits"].get("nvidia.com/gpu", 0))
        assert gpu_limit == float(group.get("rayStartParams", {}).get("num-gpus", 0)), group_name
        assert res["requests"].get("nvidia.com/gpu", 0) == res["limits"].get("nvidia.com/gpu", 0)  # extended resources
        assert quantity(res["requests"]["memory"]) == quantity(res["limits"]["memory"]), group_name
        cpus, _ = ray_resources(group)
        if group_name == "head":
            assert cpus == 0  # no actor on the head: it runs the driver and the control plane
        else:
            assert cpus == quantity(res["limits"]["cpu"]), group_name  # Ray's CPUs are the pod's
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    gpu_groups = [g for n, g in groups(spec) if ray_resources(g)[1] > 0]
    assert len(gpu_groups) == (1 if name == "raycluster.yaml" else 0)


def _sized_for(annotation: str):
    """RunConfig of an annotation ``CONFIG [--set KEY=VALUE ...]``, read as `turnrl train` does."""
    from cluster.cli import build_parser
    from cluster.config import load_config

    args = build_parser().parse_args(["train", *shlex.split(annotation)])
    assert (ROOT / args.config).is_file() and args.config.startswith("configs/")
    return load_config(ROOT / args.config, args.overrides)


def test_raycluster_groups_are_sized_for_a_real_config() -> None:
    from cluster.actors import run_cpus

    (cluster,) = docs("raycluster.yaml")
    notes = cluster["metadata"]["annotations"]
    spec = cluster_specs()["raycluster.yaml"]
    by_name = dict(groups(spec))
    cpu, gpu = by_name["cpu"], by_name["gpu"]

    cfg = _sized_for(notes["turnrl/sized-for-cpu"])
    eng, learner = cfg.rollout.engine, cfg.learner
    assert eng.count * eng.num_gpus + learner.world_size * learner.num_gpus == 0
    cpu_cpus, cpu_gpus = ray_resources(cpu)
    assert cpu_gpus == 0
    assert cpu["replicas"] * cpu_cpus == math.ceil(run_cpus(cfg))  # the whole run, no idle core beyond rounding

    cfg = _sized_for(notes["turnrl/sized-for-gpu"])
    eng, learner = cfg.rollout.engine, cfg.learner
    bundles = [(eng.num_cpus, eng.num_gpus)] * eng.count + [(learner.num_cpus, learner.num_gpus)] * learner.world_size
    pod_cpus, pod_gpus = ray_resources(gpu)
    assert all(c <= pod_cpus and 0 < g <= pod_gpus for c, g in bundles)  # each GPU actor fits one pod
    assert sum(g for _, g in bundles) == gpu["maxReplicas"] * pod_gpus  # ... and the group holds them all
    assert gpu["minReplicas"] == 0 and spec["enableInTreeAutoscaling"] is True  # CPU-only runs hold no GPU
    rest = run_cpus(cfg) - sum(c for c, _ in bundles)  # rollout workers, reward, replay: the cpu group
    assert 0 < rest <= cpu["replicas"] * cpu_cpus


def _entrypoint():
    from cluster.cli import build_parser
    from cluster.config import load_config

    (job,) = docs("rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "turnrl"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "train" and not args.print_config
    shipped = PurePosixPath(args.config)
    assert shipped.is_relative_to(workdir() / "configs"), shipped  # copied into the image with the source
    local = ROOT / shipped.relative_to(workdir())
    assert local.is_file(), local
    return job, load_config(local, args.overrides)


def test_rayjob_trains_a_shipped_config_and_shuts_its_cluster_down() -> None:
    from cluster.actors import run_cpus

    job, cfg = _entrypoint()
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec  # a cluster of its own, which shutdown deletes
    eng, learner = cfg.rollout.engine, cfg.learner
    assert eng.count * eng.num_gpus + learner.world_size * learner.num_gpus == 0  # CPU image, CPU group
    workers = [g for name, g in groups(spec["rayClusterSpec"]) if name != "head"]
    assert sum(g["replicas"] * ray_resources(g)[0] for g in workers) == math.ceil(run_cpus(cfg))


def test_rayjob_replay_points_at_the_redis_service() -> None:
    _, cfg = _entrypoint()
    svc, sts = one("redis.yaml", "Service"), one("redis.yaml", "StatefulSet")
    assert cfg.replay.type == "redis"
    url = urlsplit(cfg.replay.url)
    assert url.scheme == "redis" and url.hostname == svc["metadata"]["name"]
    (port,) = svc["spec"]["ports"]
    assert url.port == port["port"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]


def test_redis_statefulset_keeps_an_append_only_file_on_its_claim() -> None:
    svc, sts = one("redis.yaml", "Service"), one("redis.yaml", "StatefulSet")
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (redis,) = pod["spec"]["containers"]
    assert redis["image"] == compose()["services"]["redis"]["image"]  # one pinned Redis for both deployments
    args = redis["args"]
    assert args[0] == "redis-server"
    options = dict(zip(args[1::2], args[2::2]))
    assert options["--appendonly"] == "yes" and options["--appendfsync"] == "always"
    assert options["--maxmemory-policy"] == "noeviction"
    (port,) = svc["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in redis["ports"]}
    assert named[port["targetPort"]] == int(options.get("--port", 6379))
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in redis["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == options["--dir"]
    assert "ReadWriteOnce" in claim["spec"]["accessModes"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_every_pod_mounts_the_shared_run_directory() -> None:
    """Until `storage` URIs land, run directories live on a volume every pod mounts."""
    (claim,) = docs("storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    paths = set()
    for name, spec in cluster_specs().items():
        for group_name, group in groups(spec):
            pod = group["template"]["spec"]
            vols = {v["name"]: v for v in pod["volumes"]}
            mounts = [m for m in container(group)["volumeMounts"]
                      if vols[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]]
            assert len(mounts) == 1, (name, group_name)
            paths.add(mounts[0]["mountPath"])
            assert any(m["mountPath"] == "/dev/shm" and vols[m["name"]]["emptyDir"]["medium"] == "Memory"
                       for m in container(group)["volumeMounts"]), (name, group_name)
    (path,) = paths
    _, cfg = _entrypoint()
    for key, value in (("output_dir", cfg.output_dir), ("policy.cache_dir", cfg.policy.cache_dir)):
        assert PurePosixPath(value).is_relative_to(path), key
    assert PurePosixPath(path) == workdir() / "runs"  # the image creates it, owned by its user


def test_pods_run_as_the_images_user_and_use_the_dockerfiles_tags() -> None:
    uid, gid = (int(x) for x in [a for k, a in instructions(dockerfile("cpu")) if k == "USER"][-1].split(":"))
    lock_ray = lock_pins(ROOT / "requirements.lock")["ray"]
    for name, spec in cluster_specs().items():
        assert spec["rayVersion"] == lock_ray
        for group_name, group in groups(spec):
            flavour = "cuda" if ray_resources(group)[1] > 0 else "cpu"
            assert container(group)["image"] == image_tag(flavour) == build_tag(flavour), (name, group_name)
            ctx = group["template"]["spec"]["securityContext"]
            assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (True, uid, gid, gid)
    for flavour in ("cpu", "cuda"):  # one Ray cluster may mix the two images: same Ray, same Python
        (base,) = [a for k, a in instructions(dockerfile(flavour)) if k == "FROM"]
        assert base.startswith(f"rayproject/ray:{lock_ray}-py311-")
