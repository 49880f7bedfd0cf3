"""cluster.storage: folders through an fsspec URL. A run's policy, checkpoints and state go
to storage; a resume on a node without the run directory continues from storage alone. The
same run pins generation and training to disjoint cores (``cpu_affinity``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from storage import RunStorage, is_storage_url, node_copy, upload_policy


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 10)
    return root


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_folders_round_trip(tmp_path, scheme) -> None:
    url = f"memory://turnrl-test-{tmp_path.name}" if scheme == "memory" else f"file://{tmp_path}/store"
    store = RunStorage(url)
    src = _folder(tmp_path / "src")
    store.put_dir(src, "policies/p")
    store.write_text("runs/r/state.json", '{"step": 3}')
    assert store.exists("policies/p/sub/weights.bin") and not store.exists("policies/q")
    got = store.get_dir("policies/p", tmp_path / "got")
    assert (got / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
    assert (got / "config.json").read_text() == '{"a": 1}'
    assert json.loads(store.child("runs/r").read_text("state.json")) == {"step": 3}


def test_policy_uploads_once_and_each_node_copies_it_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TURNRL_NODE_CACHE", str(tmp_path / "node"))
    src = _folder(tmp_path / "policy-abc")
    url = upload_policy(src, f"file://{tmp_path}/store")
    assert url.startswith(f"file://{tmp_path}/store/policies/policy-abc-") and is_storage_url(url)
    assert upload_policy(src, f"file://{tmp_path}/store") == url  # unchanged folder: same copy
    local = Path(node_copy(url))
    assert local.parent == tmp_path / "node" and (local / "sub" / "weights.bin").exists()
    (local / "config.json").write_text("touched")
    assert node_copy(url) == str(local) and (local / "config.json").read_text() == "touched"  # cached
    (src / "config.json").write_text('{"a": 2, "changed": true}')
    assert upload_policy(src, f"file://{tmp_path}/store") != url  # a changed folder is a new copy
    assert node_copy("/some/local/path") == "/some/local/path" and node_copy("org/model") == "org/model"


@pytest.mark.slow
def test_a_run_resumes_from_storage_alone(tiny_run_config, tiny_policy, ray_cluster, tmp_path) -> None:
    from cluster.driver import train

    store_url = f"file://{tmp_path}/store"
    overrides = [f"output_dir={tmp_path}/runs", "name=stored", f"cluster.storage={store_url}",
                 "rollout.group_size=2", "learner.batch_groups=2", "rollout.max_new_tokens=32",
                 "eval.num_tasks=0", "progress=none", "learner.checkpoint_every=1"]
    # this run also gives generation and training disjoint cores (cpu_affinity), when there are two
    two_cores = len(os.sched_getaffinity(0)) >= 2
    cores = ["rollout.engine.cpu_affinity=[0]", "rollout.cpu_affinity=[0]", "learner.cpu_affinity=[1]"]
    first = train(tiny_run_config([*overrides, "train.steps=2", *(cores if two_cores else [])]),
                  on_stage=lambda s: None)
    assert first.steps == 2 and first.checkpoint == f"{store_url}/runs/stored/checkpoints/step_000002"
    if two_cores:  # every thread of each pinned process, read back from inside the actor
        placement = json.loads((tmp_path / "runs" / "stored" / "placement.json").read_text())
        assert [a["cpus"] for a in placement["engine"] + placement["rollout"]] == [[0], [0]]
        assert [a["cpus"] for a in placement["learner"]] == [[1]]
        assert placement["replay"][0]["cpus"] == sorted(os.sched_getaffinity(0))  # unpinned
    stored = tmp_path / "store" / "runs" / "stored"
    assert json.loads((stored / "state.json").read_text())["step"] == 2
    assert (stored / "checkpoints" / "step_000002" / "model.safetensors").exists()
    assert list((stored / "ds_checkpoint" / "step_000002").glob("*optim_states.pt"))
    assert len((stored / "metrics.jsonl").read_text().splitlines()) == 2
    # the actors loaded the policy from storage, through this node's copy of it
    (policy_url,) = [f"{store_url}/policies/{p.name}" for p in (tmp_path / "store" / "policies").iterdir()]
    node_cache = Path.home() / ".cache" / "turnrl" / "storage" / hashlib.sha1(policy_url.encode()).hexdigest()[:16]
    assert (node_cache / "config.json").exists()
    # a driver on a node that never saw the run directory resumes from storage
    shutil.rmtree(tmp_path / "runs")
    resumed = train(tiny_run_config([*overrides, "train.steps=3"]), on_stage=lambda s: None, resume=True)
    assert resumed.steps == 3
    assert json.loads((stored / "state.json").read_text())["step"] == 3
    rows = [json.loads(line) for line in (stored / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [json.loads(line) for line in (stored / "trained_groups.jsonl").read_text().splitlines()]
    ids = [g for t in trained for g in t["group_ids"]]
    assert [t["step"] for t in trained] == [1, 2, 3] and len(ids) == len(set(ids)) == 6
    shutil.rmtree(node_cache, ignore_errors=True)


def test_a_core_the_node_lacks_is_refused(tiny_run_config, tiny_policy, ray_cluster, tmp_path) -> None:
    from cluster.driver import train

    bad = tiny_run_config([f"output_dir={tmp_path}", "name=badcores", "eval.num_tasks=0", "progress=none",
                           "rollout.group_size=2", "learner.batch_groups=2", f"learner.cpu_affinity=[{os.cpu_count()}]"])
    with pytest.raises(Exception, match=rf"learner\.cpu_affinity=\[{os.cpu_count()}\]: this node's cores are"):
        train(bad, on_stage=lambda s: None)
