"""RunConfig: YAML + --set overrides, errors that name the key, a fast CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_demo_config_loads_with_overrides() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["learner.lr=3e-5", "train.async=false", "rollout.group_size=4"])
    assert cfg.learner.lr == 3e-5 and cfg.train.async_ is False and cfg.rollout.group_size == 4


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_as_written(path: Path) -> None:
    """Every value the file sets is the loaded config's: nothing renamed, dropped or coerced."""
    import yaml

    written = yaml.safe_load(path.read_text())
    loaded = load_config(path, []).model_dump(by_alias=True)
    _same(written, loaded, path.name)


def _same(written: object, loaded: object, where: str) -> None:
    if isinstance(written, dict) and isinstance(loaded, dict):
        for key, value in written.items():
            assert key in loaded, f"{where}.{key} is not in the loaded config"
            _same(value, loaded[key], f"{where}.{key}")
    else:
        assert written == loaded, f"{where}: the file says {written!r}, the config holds {loaded!r}"


def test_learning_bench_runs_the_demo_task_and_warm_start() -> None:
    from bench.learning import MATRIX, cell_overrides, demo_task_overrides, parse_args

    demo = load_config(ROOT / "configs" / "demo.yaml", [])
    bench = load_config(None, demo_task_overrides(ROOT / "configs" / "demo.yaml"))
    assert bench.env == demo.env and bench.policy.sft == demo.policy.sft
    for cell in MATRIX:  # every cell trains with the demo's loss (KL, aggregation, TIS)
        cfg = load_config(None, cell_overrides(cell, 0, parse_args([])))
        assert cfg.learner.loss == demo.learner.loss
        assert cfg.learner.lr == (5e-5 if cell.env == "tool_use" else demo.learner.lr)


@pytest.mark.parametrize("quick", [False, True])
def test_every_learning_bench_cell_is_a_valid_config(quick: bool) -> None:
    from bench.learning import MATRIX, cell_overrides, parse_args

    args = parse_args(["--quick"] if quick else [])
    for cell in MATRIX:
        cfg = load_config(None, cell_overrides(cell, 0, args))
        assert (cfg.env.type, cfg.learner.estimator.type) == (cell.env, cell.estimator)
        if cell.env == "tool_use" and not quick:
            assert cfg.policy.tiny.split_digits and cfg.env.max_calls == 2


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"learner\.lrr: unknown key"):
        load_config(None, ["learner.lrr=1"])


def test_bad_value_names_key_and_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"learner\.zero_stage: .*0, 1, 2 or 3"):
        load_config(None, ["learner.zero_stage=7"])
    with pytest.raises(ConfigError, match=r"learner\.estimator"):
        load_config(None, ["learner.estimator.type=nope"])


def test_override_must_be_key_value() -> None:
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(None, ["learner.lr"])


def test_every_field_has_a_docstring() -> None:
    from pydantic import BaseModel

    def walk(model: type[BaseModel], seen: set) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            for arg in getattr(field.annotation, "__args__", ()) + (field.annotation,):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, seen)

    from pydantic import ConfigDict  # noqa: F401  (docstrings become descriptions below)
    walk(RunConfig, set())


def test_config_import_stays_light() -> None:
    code = "import sys, cluster.config; bad=[m for m in ('torch','ray','transformers') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_cli_help_is_fast(argv) -> None:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *argv], capture_output=True, text=True, check=True)
    assert time.perf_counter() - t0 < 2.0
    assert "turnrl" in out.stdout


def test_training_on_live_sessions_needs_the_endpoint_and_names_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"train\.source='live'.*live\.enabled=true"):
        load_config(None, ["train.source=live"])
    with pytest.raises(ConfigError, match=r"train\.source='mixed' needs train\.async=true"):
        load_config(None, ["train.source=mixed", "live.enabled=true", "train.async=false"])
    with pytest.raises(ConfigError, match=r"learner\.batch_groups >= 2"):
        load_config(None, ["train.source=mixed", "live.enabled=true", "learner.batch_groups=1"])


@pytest.mark.parametrize("source, fraction, live", [("rollout", 0.5, 0), ("live", 0.5, 4), ("mixed", 0.5, 2),
                                                    ("mixed", 0.1, 1), ("mixed", 0.95, 3)])
def test_live_groups_per_batch(source: str, fraction: float, live: int) -> None:
    # mixed: round(fraction x 4), at least one live and one rollout group
    cfg = load_config(None, [f"train.source={source}", f"train.live_fraction={fraction}", "live.enabled=true",
                             "learner.batch_groups=4"])
    assert cfg.train.live_groups(cfg.learner.batch_groups) == live


@pytest.mark.parametrize("overrides, message", [
    (["learner.device=cuda"], r"learner\.device=cuda but learner\.num_gpus=0.*learner\.num_gpus=1"),
    (["learner.device=cpu", "learner.num_gpus=1"], r"learner\.device=cpu .*learner\.num_gpus=1 .*idle"),
    (["learner.world_size=2", "learner.num_gpus=0.5"], r"learner\.world_size=2 .*cannot share a GPU"),
    (["learner.world_size=0"], r"learner\.world_size: .*greater than or equal to 1"),
    (["learner.placement=ANYWHERE"], r"learner\.placement: .*PACK"),
    (["rollout.engine={type: vllm, tensor_parallel_size: 2, num_gpus: 1}"],
     r"tensor_parallel_size=2 .*num_gpus=1; set num_gpus=2"),
])
def test_gpu_placement_keys_are_checked_and_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_gpu_learner_and_ranks_load() -> None:
    cfg = load_config(None, ["learner.world_size=4", "learner.num_gpus=1", "learner.placement=STRICT_PACK",
                             "learner.dtype=bfloat16", "learner.zero_stage=3"])
    assert (cfg.learner.world_size, cfg.learner.num_gpus, cfg.learner.device) == (4, 1.0, "auto")
