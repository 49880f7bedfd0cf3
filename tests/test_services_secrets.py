"""Secrets survive admission (a submitted ``SecretStr`` reaches the job as written, never as
its masked form), over real HTTP with no Ray behind the service.

A run submitted with ``live.tokens`` is recorded with the masked form in ``run.yaml`` and the
real token in a 0600 ``secrets.json``; the job's entrypoint (``services.job``) rebuilds the
config with the real token, and a config holding only the masked form is refused. The live
endpoint itself answering 401 to ``**********`` and 200 to the real token is checked on a real
run in tests/test_services_e2e.py.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import BaseModel, SecretStr

from cluster.config import ConfigError, RunConfig, load_config
from services.secrets import SECRETS_FILE, secret_fields, secret_overrides

from service_fixture import ALICE, bearer, ray_down, serve

REAL = "live-token-of-alice-0123456789"


def test_a_submitted_secret_reaches_the_job_only_through_its_0600_file(tmp_path, capsys) -> None:
    body = {"name": "secret", "live": {"enabled": True, "host": "0.0.0.0", "tokens": [REAL]}}
    with serve(ray_down(tmp_path)) as svc:
        res = httpx.post(f"{svc.url}/v1/runs", json=body, headers=bearer(ALICE), timeout=120)  # first admission imports the actors
        assert res.status_code == 503  # admitted and recorded; Ray is down, so it never starts
        listed = httpx.get(f"{svc.url}/v1/runs", headers=bearer(ALICE))
        run_dir = Path(svc.state.manager.registry.list(owner="alice")[0].run_dir)
    shown = (run_dir / "run.yaml").read_text()
    assert yaml.safe_load(shown)["live"]["tokens"] == ["**********"] and REAL not in shown
    assert REAL not in res.text + listed.text
    secrets = run_dir / SECRETS_FILE
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600 and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    # the job's own entrypoint: the config it trains with holds the real token (the masked form
    # alone is refused below, so loading at all proves it), and printing it shows no secret
    from services.job import main as job_main

    capsys.readouterr()
    assert job_main([str(run_dir / "run.yaml"), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["live"]["tokens"] == ["**********"] and REAL not in printed
    # the masked form alone (someone runs `turnrl train run.yaml`) is refused, not served
    with pytest.raises(ConfigError, match="live.tokens: an empty token, or one of only"):
        load_config(run_dir / "run.yaml")


def test_the_only_secret_in_a_run_config_is_live_tokens() -> None:
    """The audit, kept true: a new SecretStr field in RunConfig shows up here and must be
    handled by services.secrets (a secret inside a list of sections is refused there)."""
    cfg = RunConfig.model_validate({"live": {"tokens": ["a-token-0123456789"]}})
    assert [(loc, real) for loc, real in secret_fields(cfg)] == [(("live", "tokens"), ["a-token-0123456789"])]

    class Holder(BaseModel):
        token: SecretStr

    class Outer(BaseModel):
        items: list[Holder]

    with pytest.raises(TypeError, match="items: secrets inside a list"):
        list(secret_fields(Outer(items=[Holder(token="x")])))


def test_any_token_text_survives_the_way_back(tmp_path) -> None:
    """secrets.json -> --set overrides (JSON read as YAML) -> the config: byte-exact."""
    from cluster.config import apply_overrides, build_config
    from services.secrets import write_secrets

    odd = ["plain-token-0123456789", 'quo"te\\back: colon # hash', "tab\tnew\nline", "ünï-cødé ✓ 😀", "- [x]: {y}"]
    cfg = build_config({"live": {"tokens": odd}})
    write_secrets(tmp_path, cfg)
    back = build_config(apply_overrides({}, secret_overrides(tmp_path / "run.yaml")))
    assert [t.get_secret_value() for t in back.live.tokens] == odd
