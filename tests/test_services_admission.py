"""Admission: what a RunConfig submitted over the API may reach, and per-tenant limits.

Over real HTTP (no Ray behind the service: an admitted run answers 503 after the service has
written its run.yaml, a refused one 422 before anything exists), and ``Admission`` directly for
the path-resolution matrix (``..``, symlinks, absolute paths). The schema walk at the end keeps
``services.admission.RULES`` complete.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml
from pydantic import BaseModel

from config_walk import field_types, section_models

from cluster.config import RunConfig, build_config
from services.admission import RULES, Admission, InvalidRunConfig, demand
from services.config import ServiceConfig, ServiceConfigError
from services.registry import RunRecord

from service_fixture import ALICE, BOB, VIEWER, Service, bearer, ray_down, serve

JUDGE_OK = "tests.judges:rate"  # only compared as a name: never imported by these tests
REDIS_OK = "redis://replay.internal:6379/0"
STORE_OK = "s3://team-models/released"  # the operator's one storage prefix


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> Path:
    """models/, data/ (allowed), outside/ (not), and symlinks from inside to both."""
    tmp = tmp_path_factory.mktemp("roots")
    for d in ("models/policy", "data", "outside/secret"):
        (tmp / d).mkdir(parents=True)
    (tmp / "data" / "train.jsonl").write_text("{}\n")
    (tmp / "outside" / "stolen.jsonl").write_text("{}\n")
    (tmp / "models" / "escape").symlink_to(tmp / "outside" / "secret")  # inside -> outside
    (tmp / "models" / "alias").symlink_to(tmp / "models" / "policy")  # inside -> inside
    (tmp / "data" / "link.jsonl").symlink_to(tmp / "outside" / "stolen.jsonl")
    return tmp


def service_config(tmp: Path, roots: Path, **extra: Any) -> ServiceConfig:
    admission = {"model_roots": [str(roots / "models")], "data_roots": [str(roots / "data")],
                 "hub_models": ["Qwen/Qwen2.5-0.5B-Instruct"], "judge_functions": [JUDGE_OK],
                 "storage_urls": [STORE_OK],
                 "redis_servers": [{"url": REDIS_OK, "password_env": "REPLAY_REDIS_PASSWORD"}],
                 "redis_server_binary": "/opt/redis/bin/redis-server",
                 "env_sources": ["examples.envs.sums:SumSource"], "verifiers_envs": ["examples.envs.vf_sums"],
                 "mcp_servers": [{"name": "time", "command": "/opt/mcp/python", "args": ["-m", "mcp_server_time"]}],
                 **extra.pop("admission", {})}
    return ray_down(tmp / "state", jobs={"working_dir": str(roots)}, admission=admission,
                    limits={"max_steps": 1000, "max_cpus": 4, "max_actors": 8, "max_concurrent_runs": 2},
                    tenant_limits={"bob": {"max_steps": 50}}, **extra)


@pytest.fixture(scope="module")
def service(tmp_path_factory, roots) -> Iterator[Service]:
    with serve(service_config(tmp_path_factory.mktemp("adm"), roots)) as svc:
        yield svc


def submit(service: Service, body: dict, token: str = ALICE) -> httpx.Response:
    # generous: the first admission imports the actor modules (seconds on a busy machine)
    return httpx.post(f"{service.url}/v1/runs", json=body, headers=bearer(token), timeout=120)


def refused(service: Service, body: dict, token: str = ALICE) -> dict[str, str]:
    """{loc: msg} of a 422, after checking that nothing was recorded or created."""
    runs_dir = service.state.manager.runs_dir
    before = (sorted(os.listdir(runs_dir)), service.state.manager.registry.count_by_status())
    res = submit(service, body, token)
    assert res.status_code == 422, res.text
    assert (sorted(os.listdir(runs_dir)), service.state.manager.registry.count_by_status()) == before
    return {e["loc"]: e["msg"] for e in res.json()["detail"]}


def admitted(service: Service, body: dict, token: str = ALICE) -> dict[str, Any]:
    """The run.yaml the service wrote for an admitted run (Ray is down: 503 after that)."""
    res = submit(service, body, token)
    assert res.status_code == 503, res.text
    run = httpx.get(f"{service.url}/v1/runs", headers=bearer(token)).json()["runs"][0]
    assert run["status"] == "failed"
    return yaml.safe_load((service.state.manager.runs_dir / run["id"] / "run.yaml").read_text())


def test_the_issues_os_system_judge_is_refused_naming_the_field(service: Service) -> None:
    body = {"rewards": {"prm": {"type": "judge", "backend": "callable", "function": "os:system"}}}
    errors = refused(service, body)
    assert errors == {"rewards.prm.function": f"'os:system' is not allowed: allowed judge functions are "
                                              f"['{JUDGE_OK}'] (admission.judge_functions)"}
    # the same config is still a valid RunConfig for `turnrl train` on the command line
    assert build_config(body).rewards.prm.function == "os:system"


def test_mcp_servers_are_the_operators_named_never_launched_by_the_submitter(service: Service) -> None:
    env = {"type": "tool_use", "mcp": [{"name": "time", "tools": ["convert_time"], "call_timeout_s": 5}]}
    cfg = admitted(service, {"env": env})
    assert cfg["env"]["mcp"] == [{"name": "time", "command": "/opt/mcp/python", "args": ["-m", "mcp_server_time"], "env": {},
                                  "cwd": None, "url": None, "tools": ["convert_time"], "call_timeout_s": 5.0, "stateful": False}]
    errors = refused(service, {"env": {"type": "tool_use", "mcp": [
        {"name": "time", "command": "sh", "args": ["-c", "cat /etc/passwd"]}, {"name": "shell", "url": "http://10.0.0.1/mcp"}]}})
    launch = "servers are the operator's: give only their name (one of admission.mcp_servers) and remove "
    assert errors == {"env.mcp.0.command": launch + "command", "env.mcp.0.args": launch + "args",
                      "env.mcp.1.name": "'shell' is not allowed: allowed servers are ['time'] (admission.mcp_servers)",
                      "env.mcp.1.url": launch + "url"}


def test_a_custom_environment_is_one_of_the_operators_sources(service: Service) -> None:
    errors = refused(service, {"env": {"type": "custom", "source": "os:system", "args": {"command": "id"}}})
    assert errors == {"env.source": "'os:system' is not allowed: allowed environment sources are "
                                     "['examples.envs.sums:SumSource'] (admission.env_sources)"}
    cfg = admitted(service, {"env": {"type": "custom", "source": "examples.envs.sums:SumSource", "args": {"seed": 3}}})
    assert cfg["env"] == {"type": "custom", "source": "examples.envs.sums:SumSource", "args": {"seed": 3}}


def test_a_verifiers_environment_is_one_of_the_operators(service: Service) -> None:
    errors = refused(service, {"env": {"type": "verifiers", "id": "os", "args": {"command": "id"}}})
    assert errors == {"env.id": "'os' is not allowed: allowed verifiers environments are "
                                "['examples.envs.vf_sums'] (admission.verifiers_envs)"}
    cfg = admitted(service, {"env": {"type": "verifiers", "id": "examples.envs.vf_sums", "args": {"num_examples": 40}}})
    assert cfg["env"]["id"] == "examples.envs.vf_sums" and cfg["env"]["args"] == {"num_examples": 40}


def test_an_allowed_judge_function_is_admitted(service: Service) -> None:
    cfg = admitted(service, {"rewards": {"prm": {"type": "judge", "backend": "callable", "function": JUDGE_OK}}})
    assert cfg["rewards"]["prm"]["function"] == JUDGE_OK


def test_redis_server_binary_is_the_operators(service: Service) -> None:
    errors = refused(service, {"replay": {"type": "redis", "server_binary": "/bin/sh"}})
    assert errors == {"replay.server_binary": "'/bin/sh' is not allowed: the service's operator sets it "
                                              "(admission.redis_server_binary='/opt/redis/bin/redis-server'); "
                                              "remove it"}
    cfg = admitted(service, {"replay": {"type": "redis"}})  # unset: the operator's binary is used
    assert cfg["replay"]["server_binary"] == "/opt/redis/bin/redis-server"


def test_replay_reaches_only_embedded_or_listed_redis(service: Service) -> None:
    errors = refused(service, {"replay": {"type": "redis", "url": "redis://attacker.example:6379/0"}})
    assert errors["replay.url"].startswith("'redis://attacker.example:6379/0' is not allowed: allowed are "
                                           f"'embedded' and ['{REDIS_OK}']")
    # an environment variable of the job, sent as a password: refused, and set by the service
    errors = refused(service, {"replay": {"type": "redis", "url": REDIS_OK, "password_env": "TURNRL_SERVICE_TOKENS"}})
    assert errors["replay.password_env"].startswith("'TURNRL_SERVICE_TOKENS' is not allowed")
    cfg = admitted(service, {"replay": {"type": "redis", "url": REDIS_OK}})
    assert cfg["replay"]["password_env"] == "REPLAY_REDIS_PASSWORD"


@pytest.mark.parametrize("body, loc", [
    ({"policy": {"path": "/etc"}}, "policy.path"),
    ({"policy": {"path": "models/../outside/secret"}}, "policy.path"),
    ({"policy": {"path": "models/escape"}}, "policy.path"),
    ({"rewards": {"prm": {"type": "model", "path": "outside/secret"}}}, "rewards.prm.path"),
    ({"rewards": {"prm": {"type": "model", "path": "models/policy", "train": {"init_from": "/"}}}},
     "rewards.prm.train.init_from"),
    ({"rewards": {"prm": {"type": "judge", "path": "gpt2"}}}, "rewards.prm.path"),
    ({"env": {"type": "tool_use", "train_path": "data/link.jsonl", "heldout_path": "data/train.jsonl"}},
     "env.train_path"),
    ({"env": {"data": {"train_path": "data/train.jsonl", "heldout_path": "data/train.jsonl",
                       "corpus_path": "/etc/passwd"}}}, "env.data.corpus_path"),
    ({"policy": {"sft": {"env": {"data": {"train_path": "outside/stolen.jsonl", "heldout_path": "data/train.jsonl",
                                          "corpus_path": "data/train.jsonl"}}}}}, "policy.sft.env.data.train_path"),
    ({"policy": {"cache_dir": "/tmp/shared"}}, "policy.cache_dir"),
    ({"policy": {"cache_dir": "../bobs-run/checkpoints"}}, "policy.cache_dir"),
    ({"env": {"data": {"train_path": "data/train.jsonl", "heldout_path": "data/train.jsonl",
                       "corpus_path": "data/train.jsonl", "index_cache_dir": "x/../../.."}}}, "env.data.index_cache_dir"),
])
def test_paths_outside_the_allowed_roots_are_422(service: Service, body: dict, loc: str) -> None:
    errors = refused(service, body)
    assert list(errors) == [loc] and "is not allowed" in errors[loc]


@pytest.mark.parametrize("value, kind, says", [
    ("file:///etc", "not_allowed_path", "(resolves to /etc) is not allowed"),
    ("file://{roots}/models/../outside/secret", "not_allowed_path", "outside/secret) is not allowed"),
    ("file://evil.example/{roots}/models/policy", "not_allowed_host", "a file:// URL names a local path"),
    ("http://169.254.169.254/latest/meta-data/", "not_allowed_host", "a link-local address"),
    ("http://[fe80::1]/m", "not_allowed_host", "a link-local address"),
    ("http://127.0.0.1:8080/m", "not_allowed_host", "a loopback address"),
    ("http://localhost/m", "not_allowed_host", "a loopback host"),
    ("http://[::ffff:127.0.0.1]/m", "not_allowed_host", "a loopback address"),
    ("s3://another-bucket/released/m", "not_allowed_url", "URLs under admission.storage_urls"),
    ("s3://team-models/releasedX/m", "not_allowed_url", "URLs under admission.storage_urls"),
    ("s3://team-models/released/../private/m", "not_allowed_url", "URLs under admission.storage_urls"),
    ("gs://team-models/released/m", "not_allowed_url", "URLs under admission.storage_urls"),
    ("models/missing", "missing_path", "does not exist; a path is never looked up on the Hugging Face hub"),
    ("{roots}/models/policy/nothing-here", "missing_path", "does not exist"),
])
def test_every_form_of_a_place_gets_one_meaning(service: Service, roots: Path, value: str, kind: str,
                                                says: str) -> None:
    """storage.places' rule, for URLs, file:// and paths alike (422 naming the field)."""
    res = submit(service, {"policy": {"path": value.format(roots=roots)}})
    assert res.status_code == 422, res.text
    [error] = res.json()["detail"]
    assert (error["loc"], error["type"]) == ("policy.path", kind) and says in error["msg"], error


def test_data_fields_take_paths_and_file_urls_only(service: Service, roots: Path) -> None:
    data = {"train_path": f"file://{roots}/data/train.jsonl", "heldout_path": "data/train.jsonl",
            "corpus_path": f"{STORE_OK}/corpus.jsonl"}
    errors = refused(service, {"env": {"data": data}})
    assert list(errors) == ["env.data.corpus_path"] and "takes local paths only" in errors["env.data.corpus_path"]
    cfg = admitted(service, {"env": {"data": {**data, "corpus_path": "data/train.jsonl"}}})
    assert cfg["env"]["data"]["train_path"] == str(roots / "data" / "train.jsonl")  # file:// became its path


def test_the_dense_retriever_takes_local_folders_only(service: Service) -> None:
    data = {"train_path": "data/train.jsonl", "heldout_path": "data/train.jsonl", "corpus_path": "data/train.jsonl",
            "retriever": "dense", "dense_model_path": "Qwen/Qwen2.5-0.5B-Instruct"}
    errors = refused(service, {"env": {"data": data}})
    assert list(errors) == ["env.data.dense_model_path"] and "hub id" not in errors["env.data.dense_model_path"]


def test_allowed_places_pass_as_the_runtime_reads_them(service: Service, roots: Path) -> None:
    assert admitted(service, {"policy": {"path": f"{STORE_OK}/smol"}})["policy"]["path"] == f"{STORE_OK}/smol"
    assert admitted(service, {"policy": {"path": f"file://{roots}/models/policy"}})["policy"]["path"] == str(
        roots / "models" / "policy")
    assert admitted(service, {"policy": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}})["policy"]["path"] == (
        "Qwen/Qwen2.5-0.5B-Instruct")  # on the hub list: the one value that reaches the hub


@pytest.mark.parametrize("prefix", ["http://169.254.169.254/x", "https://localhost/m", "file:///models", "s3:/x"])
def test_storage_url_prefixes_are_checked_at_start(tmp_path, roots: Path, prefix: str) -> None:
    with pytest.raises(ServiceConfigError, match="admission.storage_urls: "):
        Admission(service_config(tmp_path, roots, admission={"storage_urls": [prefix]}))


def test_refusals_say_what_is_allowed(service: Service, roots: Path) -> None:
    errors = refused(service, {"policy": {"path": "models/../outside/secret"}})
    assert errors["policy.path"] == (
        f"'models/../outside/secret' (resolves to {roots / 'outside' / 'secret'}) is not allowed: allowed are "
        f"'builtin:tiny'; 'builtin:smollm2'; 'hub id Qwen/Qwen2.5-0.5B-Instruct'; a path under admission.model_roots "
        f"['{roots / 'models'}']")
    errors = refused(service, {"policy": {"cache_dir": "/tmp/shared"}})
    assert errors["policy.cache_dir"] == ("'/tmp/shared' is not allowed: runs write only inside their own "
                                          "directory; give a relative path without '..' (or leave it unset)")
    # a write field meets storage.places' rule as a read field does: a URL is no folder name
    errors = refused(service, {"policy": {"cache_dir": "http://cache.example/policies"}})
    assert errors["policy.cache_dir"] == ("policy.cache_dir: 'http://cache.example/policies' is a URL, but runs "
                                          "write policy.cache_dir to a local directory; give a path "
                                          "(cluster.storage puts a run's files in remote storage)")
    errors = refused(service, {"policy": {"cache_dir": "file:///tmp/shared"}})  # its path, outside the run
    assert errors["policy.cache_dir"].startswith("'file:///tmp/shared' is not allowed: runs write only inside")


def test_allowed_reads_and_writes_resolve_into_place(service: Service, roots: Path) -> None:
    data = {"train_path": "data/train.jsonl", "heldout_path": str(roots / "data" / "train.jsonl"),
            "corpus_path": "data/train.jsonl"}
    cfg = admitted(service, {"policy": {"path": "models/alias", "cache_dir": "cache/p"}, "env": {"data": data}})
    run_dir = Path(cfg["output_dir"]) / cfg["name"]
    # a symlink that stays inside the root: the runtime gets the resolved path it was checked as
    assert cfg["policy"]["path"] == str(roots / "models" / "policy")
    assert cfg["env"]["data"]["train_path"] == str(roots / "data" / "train.jsonl")
    assert cfg["policy"]["cache_dir"] == str(run_dir / "cache" / "p")
    assert cfg["env"]["data"]["index_cache_dir"] == str(run_dir / ".cache" / "search_index")  # the default, moved
    defaults = admitted(service, {"policy": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}})
    run_dir = Path(defaults["output_dir"]) / defaults["name"]
    assert defaults["policy"]["cache_dir"] == str(run_dir / ".cache" / "turnrl" / "policies")
    assert defaults["output_dir"] == str(service.state.manager.runs_dir) and defaults["progress"] == "log"


def test_a_tenant_cache_is_per_token_name(tmp_path, roots: Path) -> None:
    cfg = service_config(tmp_path, roots, admission={"cache_dir": str(tmp_path / "cache")})
    adm = Admission(cfg)
    run_cfg = adm.admit(build_config({}), {}, "alice", cfg.runs_path() / "run-1")
    assert run_cfg.policy.cache_dir == str(tmp_path / "cache" / "alice" / "policies")


@pytest.mark.parametrize("field", ["model_roots", "data_roots"])
@pytest.mark.parametrize("root", ["{tmp}", "{tmp}/state/runs", "{tmp}/state/runs/some-run"])
def test_read_roots_overlapping_the_runs_fail_at_start(tmp_path, roots, field: str, root: str) -> None:
    cfg = service_config(tmp_path, roots, admission={field: [root.format(tmp=tmp_path)]})
    with pytest.raises(ServiceConfigError, match=rf"admission\.{field}: .* overlaps (state_dir|runs_dir)"):
        Admission(cfg)


def test_limits_name_the_limit(service: Service) -> None:
    errors = refused(service, {"train": {"steps": 1001}})
    assert errors == {"train.steps": "1001 is over limits.max_steps=1000 for tenant 'alice'"}
    assert refused(service, {"train": {"steps": 51}}, BOB) == {
        "train.steps": "51 is over limits.max_steps=50 for tenant 'bob'"}  # bob's override
    # every number that buys CPU, memory or time has a limit (services/limits.py)
    assert refused(service, {"policy": {"sft": {"steps": 2001}}, "learner": {"torch_threads": 9}}) == {
        "policy.sft.steps": "2001 is over limits.max_sft_steps=2000 for tenant 'alice'",
        "learner.torch_threads": "9 is over limits.max_threads=8 for tenant 'alice'"}
    # 3 x 0.1 (rollout) + 1.2 (engine) + 1 (learner) + 0.25 + 0.25 (reward, replay)
    # + 4 x 0.25 (env actors) = 4.0: at the limit
    at_limit = {"rollout": {"num_workers": 3, "env_actors": {"count": 4}, "engine": {"num_cpus": 1.2}}}
    assert demand(build_config(at_limit)) == {"actors": 4 + 3 + 1 + 4, "cpus": pytest.approx(4.0), "gpus": 0}
    errors = refused(service, at_limit)
    assert errors == {"<root>": "the run asks for 12 actors (rollout.num_workers + rollout.engine.count + "
                                "rollout.env_actors.count + reward scorers/judges + live gateway + "
                                "learner.world_size + 3); "
                                "limits.max_actors=8 for tenant 'alice'"}
    # 0.1 + 0.4 (engine) + 2.5 + 0.25 + 0.25 = 3.5
    assert admitted(service, {"learner": {"num_cpus": 2.5}})["learner"]["num_cpus"] == 2.5
    errors = refused(service, {"learner": {"num_cpus": 3.5}})  # ... 4.5 is not
    assert errors == {"<root>": "the run asks for 4.5 cpus (the num_cpus of every actor); limits.max_cpus=4 "
                                "for tenant 'alice'"}
    gpu_limit = ("(rollout.engine.count x rollout.engine.num_gpus (an hf engine whose device is not cpu counts "
                 "at least 1, a vllm engine at least its tensor_parallel_size above 1) + learner.world_size x "
                 "learner.num_gpus); limits.max_gpus=0 for tenant 'alice'")
    errors = refused(service, {"rollout": {"engine": {"device": "cuda"}}})
    assert errors == {"<root>": f"the run asks for 1 gpus {gpu_limit}",  # and it would see no GPU:
                      "rollout.engine.num_gpus": "rollout.engine.device='cuda' needs rollout.engine.num_gpus >= 1 "
                                                 "(or a fraction): an engine that reserves no GPU sees none"}
    # every rank of a GPU learner counts, as do its ranks among the actors
    two_gpu_ranks = {"learner": {"world_size": 2, "num_gpus": 1, "num_cpus": 0.5}}
    assert demand(build_config(two_gpu_ranks))["gpus"] == 2
    assert demand(build_config(two_gpu_ranks))["actors"] == demand(build_config({}))["actors"] + 1
    assert refused(service, two_gpu_ranks) == {"<root>": f"the run asks for 2 gpus {gpu_limit}"}
    # a vLLM engine (no torch device of its own: the installed build's) counts its num_gpus; the
    # schema fuzzer found demand() failing on it with a 500
    vllm = {"rollout": {"engine": {"type": "vllm", "count": 2, "num_gpus": 1}}}
    assert demand(build_config(vllm))["gpus"] == 2 and demand(build_config({"rollout": {"engine": {"type": "vllm"}}}))["gpus"] == 0
    assert refused(service, vllm) == {"<root>": f"the run asks for 2 gpus {gpu_limit}"}
    # tensor parallelism shards over GPUs whatever num_gpus reserves: demand counts them
    tp8 = {"rollout": {"engine": {"type": "vllm", "tensor_parallel_size": 8}}}
    assert demand(build_config(tp8))["gpus"] == 8
    assert refused(service, tp8) == {"<root>": f"the run asks for 8 gpus {gpu_limit}"}


def test_concurrent_runs_over_the_limit_get_429(service: Service) -> None:
    registry = service.state.manager.registry
    for i in range(2):  # alice's limit is 2 active runs
        registry.add(RunRecord(id=f"busy-{i}", owner="alice", name="busy", status="running", run_dir="/nonexistent",
                               total_steps=1, created_at=1e12, updated_at=1e12))
    try:
        res = submit(service, {})
        assert res.status_code == 429
        assert res.json() == {"detail": "'alice' has 2 active runs; limits.max_concurrent_runs=2: wait for one "
                                        "to finish or stop one"}
        assert submit(service, {}, BOB).status_code == 503  # bob's own count is 0: admitted
        assert submit(service, {}, VIEWER).status_code == 403
    finally:
        for i in range(2):
            registry.delete(f"busy-{i}")


# -- the rule list cannot rot ---------------------------------------------------------------
SUSPICIOUS = re.compile(r"path|dir|file|binary|exe|function|callable|module|command|cmd|script|url|uri|"
                        r"host|address|socket|env|plugin|import|class|hook")


def _names_nothing(t: Any) -> bool:
    """Numbers, flags, fixed choices and sections (walked themselves) cannot name code or a file."""
    return (t in (int, float, bool, type(None)) or typing.get_origin(t) is typing.Literal
            or isinstance(t, type) and issubclass(t, BaseModel))


def test_every_free_text_or_path_like_field_is_classified() -> None:
    models = section_models(RunConfig)
    unclassified = []
    for cls_name, model in models.items():
        for name, info in model.model_fields.items():
            kinds = field_types(info.annotation)
            free_text = any(t is str or t is Any for t in kinds)
            named_like = SUSPICIOUS.search(name) and not all(_names_nothing(t) for t in kinds[1:] or kinds)
            if (free_text or named_like) and f"{cls_name}.{name}" not in RULES:
                unclassified.append(f"{cls_name}.{name}: {info.annotation}")
    assert unclassified == [], ("classify these in services/admission.py RULES (what they may reach, or "
                                f"'inert' with why): {unclassified}")
    stale = [key for key in RULES if key.split(".")[1] not in models.get(key.split(".")[0], BaseModel).model_fields]
    assert stale == []
    assert all(rule.why for rule in RULES.values() if rule.kind in ("inert", "service"))


def test_admission_sees_every_classified_field_of_a_full_config(roots: Path, tmp_path) -> None:
    """A config setting every sensitive field at once: each is checked where it is nested."""
    bad = str(roots / "outside" / "secret")
    body = {"policy": {"path": bad, "cache_dir": "/x", "sft": {"env": {"train_path": bad, "heldout_path": bad}}},
            "env": {"type": "tool_use", "train_path": bad, "heldout_path": bad},
            "rewards": {"prm": {"type": "judge", "backend": "callable", "function": "os:system", "path": bad}},
            "replay": {"type": "redis", "url": "redis://x:1", "password_env": "HOME", "server_binary": "sh"}}
    cfg = service_config(tmp_path, roots)
    with pytest.raises(InvalidRunConfig) as err:
        Admission(cfg).admit(build_config(body), body, "alice", cfg.runs_path() / "r")
    assert sorted(e["loc"] for e in err.value.errors) == sorted([
        "policy.path", "policy.cache_dir", "policy.sft.env.train_path", "policy.sft.env.heldout_path",
        "env.train_path", "env.heldout_path", "rewards.prm.path", "rewards.prm.function", "replay.url",
        "replay.password_env", "replay.server_binary"])
