"""storage.places: one meaning for every value that names a model or data place (admission and
the runtime classify a path, a ``file://`` URL and any other URL the same way).

The same ``classify`` serves admission (tests/test_services_admission.py checks each form over
HTTP) and the runtime (``model_ref`` / ``local_model``, where ``from_pretrained`` gets its path).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.places import PlaceError, classify, forbidden_host, local_model, model_ref, split_url, under_prefix


@pytest.mark.parametrize("host, why", [
    ("localhost", "a loopback host"), ("LOCALHOST.", "a loopback host"), ("db.localhost", "a loopback host"),
    ("127.0.0.1", "a loopback address"), ("127.8.9.10", "a loopback address"), ("[::1]", "a loopback address"),
    ("::ffff:127.0.0.1", "a loopback address"), ("169.254.169.254", "a link-local address"),
    ("fe80::1%eth0", "a link-local address"), ("0.0.0.0", "the unspecified address"),
    ("10.0.0.5", None), ("models.example.com", None), ("team-bucket", None),
])
def test_forbidden_hosts(host: str, why: str | None) -> None:
    got = forbidden_host(host)
    assert (got if got is None else got[:len(why)]) == why


def test_classify_each_form(tmp_path: Path) -> None:
    (tmp_path / "models" / "policy").mkdir(parents=True)
    assert classify("s3://bucket/m", tmp_path).kind == "url"
    assert classify("HTTPS://models.example.com/m", tmp_path).url.scheme == "https"
    # file:// means exactly the path, resolved as one (.. included)
    place = classify(f"file://{tmp_path}/models/../models/policy", tmp_path)
    assert (place.kind, place.path) == ("path", tmp_path / "models" / "policy")
    assert classify(f"file://localhost{tmp_path}/models", tmp_path).path == tmp_path / "models"
    assert classify("models/policy", tmp_path).path == tmp_path / "models" / "policy"  # relative: from base
    assert classify("Qwen/Qwen2.5-0.5B-Instruct", tmp_path).kind == "hub"  # no such path: a hub id
    assert classify("./not-here", tmp_path).kind == "path" and classify("/abs/not-here", tmp_path).kind == "path"
    assert classify("a/b/c", tmp_path).kind == "path"  # three parts: no hub id
    assert classify("x" * 5000 + "/y/z", tmp_path).kind == "path"  # a name the OS refuses: no error
    assert split_url("models/x://y") is None and classify("models/x://y", tmp_path).kind == "path"
    for bad in ("http://169.254.169.254/latest/meta-data/", "http://[::1]:8000/m", "file://evil.example/etc",
                "http://host:notaport/m"):
        with pytest.raises(PlaceError):
            classify(bad, tmp_path)


@pytest.mark.parametrize("value, inside", [
    ("s3://team/released/m", True), ("s3://team/released", True), ("S3://TEAM/released/m", True),
    ("s3://team/releasedX/m", False), ("s3://team/released/../private", False), ("s3://other/released/m", False),
    ("gs://team/released/m", False), ("s3://team/released/m?versionId=1", False),
])
def test_url_prefixes_match_scheme_bucket_and_whole_segments(value: str, inside: bool) -> None:
    assert under_prefix(split_url(value), "s3://team/released") is inside


def test_the_runtime_never_takes_a_missing_path_for_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy").mkdir()
    assert model_ref("policy") == str(tmp_path / "policy")  # resolved: loaded as exactly that folder
    assert model_ref(f"file://{tmp_path}/policy") == str(tmp_path / "policy")
    assert model_ref("gpt2") == "gpt2" and model_ref("s3://bucket/m") == "s3://bucket/m"
    with pytest.raises(FileNotFoundError, match=r"rewards.prm.path: '/abs/missing' does not exist .* never looked up"):
        local_model("/abs/missing", "rewards.prm.path")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_model(str(tmp_path / "policy" / "gone"))
    # a stored folder becomes this node's copy
    monkeypatch.setenv("TURNRL_NODE_CACHE", str(tmp_path / "node-cache"))
    (tmp_path / "store" / "m").mkdir(parents=True)
    (tmp_path / "store" / "m" / "config.json").write_text("{}")
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "store" / "m"), "/places-test/m", recursive=True)
    local = Path(local_model("memory://places-test/m"))
    assert local.is_relative_to(tmp_path / "node-cache") and (local / "config.json").read_text() == "{}"


def test_the_policy_path_goes_through_the_rule(tmp_path: Path) -> None:
    """learner.bootstrap.ensure_policy: where a run's policy path is decided for every actor."""
    from cluster.config import build_config
    from learner.bootstrap import ensure_policy

    def policy(path: str) -> Path | str:
        cfg = build_config({"policy": {"path": path}})
        return ensure_policy(cfg.policy, cfg.env, source=None)

    (tmp_path / "policy").mkdir()
    assert policy(f"file://{tmp_path}/policy") == tmp_path / "policy"
    assert policy("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # hub: as it is
    assert policy("s3://bucket/policy") == "s3://bucket/policy"  # each node copies it (node_copy)
    with pytest.raises(FileNotFoundError, match="policy.path: .* does not exist"):
        policy(str(tmp_path / "gone"))


def test_write_fields_name_local_directories_by_the_same_rule(tmp_path: Path, monkeypatch) -> None:
    """Output and cache folders: a path resolves (``file://`` is its path), a URL is refused
    naming the field instead of becoming a folder called ``http:`` in the working directory."""
    from storage.places import local_dir

    monkeypatch.chdir(tmp_path)
    assert local_dir("runs", "output_dir") == tmp_path / "runs"  # hub-shaped, still a folder here
    assert local_dir("cache/p", "policy.cache_dir", base=tmp_path / "run") == tmp_path / "run" / "cache" / "p"
    assert local_dir(f"file://{tmp_path}/c", "policy.cache_dir") == tmp_path / "c"
    with pytest.raises(PlaceError, match=r"^output_dir: 'http://example.com/runs' is a URL, but runs write "
                                         r"output_dir to a local directory"):
        local_dir("http://example.com/runs", "output_dir")


def test_a_url_output_dir_stops_the_cli_before_anything_is_written(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cluster.cli", "train", "--set", "output_dir=http://example.com/runs"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 2, out.stderr
    assert "error: output_dir: 'http://example.com/runs' is a URL" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no folder named after the URL
