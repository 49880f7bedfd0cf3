"""``turnrl eval CONFIG --checkpoint PATH``: held-out success of a saved policy.

Loads the checkpoint through the rollout engine the config names (the path training uses),
plays ``eval.num_tasks`` held-out tasks of the configured environment ``eval.samples_per_task``
times each at ``eval.temperature``, and reports success with a bootstrap 95% interval over
tasks, the environment's own metrics (``TaskSource.episode_metrics``) and one JSONL row per
task. Runs in this process: no Ray cluster is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

EPILOG = "Config overrides: --set eval.num_tasks=50 --set eval.temperature=0 (values parsed as YAML)."


def resolve_checkpoint(path: str) -> Path:
    """A Hugging Face folder (``runs/NAME/checkpoints/step_N``), a LoRA run's checkpoint
    (its adapter, naming its base), or a run directory, whose ``state.json`` names its last
    checkpoint."""
    from learner.lora import is_lora_checkpoint

    p = Path(path)
    if (p / "state.json").is_file():
        p = Path(json.loads((p / "state.json").read_text())["hf_path"])
    if not (p / "config.json").is_file() and not is_lora_checkpoint(p):
        raise ValueError(f"--checkpoint {path}: not a Hugging Face model folder (no config.json), a LoRA "
                         "checkpoint nor a run directory with state.json; pass runs/NAME/checkpoints/step_N")
    return p


def load_path(checkpoint: Path) -> Path:
    """The folder an engine loads for ``checkpoint``: a LoRA checkpoint's merge with its base
    (built once, into ``<checkpoint>/merged``), else the checkpoint itself."""
    from learner.lora import merged_folder

    return merged_folder(checkpoint)


def evaluate_checkpoint(cfg: Any, checkpoint: Path, show_progress: bool = True) -> list[dict[str, Any]]:
    """One row per held-out task (see ``RolloutWorker.score_task``), in task order."""
    from tqdm import tqdm

    from rollout.engines import local_client
    from rollout.episode import sampling_params
    from rollout.worker import RolloutWorker

    engine = local_client(cfg.rollout.engine, str(load_path(checkpoint)), seed=cfg.train.seed)
    worker = RolloutWorker(0, cfg.rollout, cfg.env, engine, cfg.train.seed, ports=None)
    tasks = worker.source.tasks("heldout")[: cfg.eval.num_tasks]
    params = sampling_params(cfg.rollout, cfg.eval.temperature)

    async def run() -> list[dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        try:
            with tqdm(total=len(tasks), desc="eval", unit="task", disable=not show_progress) as bar:
                for done in asyncio.as_completed(
                        [worker.score_task(t, cfg.eval.samples_per_task, params) for t in tasks]):
                    row = await done
                    rows[row["task_id"]] = row
                    bar.update(1)
        finally:  # vLLM's engine left to its __del__ fails at interpreter exit
            await engine.engine.close()
        return [rows[t.task_id] for t in tasks]

    return asyncio.run(run())


def summarize(rows: list[dict[str, Any]], resamples: int, seed: int) -> dict[str, Any]:
    """Mean success with its bootstrap 95% interval over tasks, and each metric's mean."""
    import numpy as np

    from cluster.paired_bootstrap import bootstrap_mean_ci

    success = np.array([r["success"] for r in rows])
    low, high = bootstrap_mean_ci(success, resamples, seed)
    names = sorted({k for r in rows for k in r["metrics"]})
    metrics = {k: float(np.mean([r["metrics"][k] for r in rows if k in r["metrics"]])) for k in names}
    return {"tasks": len(rows), "success": float(success.mean()), "ci95": [low, high],
            "turns": float(np.mean([r["turns"] for r in rows])), "metrics": metrics}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnrl eval", epilog=EPILOG,
                                description="Held-out success of a checkpoint, with a bootstrap 95% interval.")
    p.add_argument("config", nargs="?", help="YAML RunConfig (the run's env, rollout and eval sections)")
    p.add_argument("--checkpoint", required=True,
                   help="a Hugging Face folder (runs/NAME/checkpoints/step_N) or a run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path; repeatable")
    p.add_argument("--out", help="per-task JSONL (default: runs/NAME/eval/<checkpoint folder>.jsonl)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv[1:] if argv[:1] == ["eval"] else argv)
    from cluster.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        checkpoint = resolve_checkpoint(args.checkpoint)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.eval.num_tasks == 0:
        print("error: eval.num_tasks is 0: set it to the number of held-out tasks to play", file=sys.stderr)
        return 2
    out = Path(args.out or Path(cfg.output_dir) / cfg.name / "eval" / f"{checkpoint.name}.jsonl")
    rows = evaluate_checkpoint(cfg, checkpoint, show_progress=cfg.progress == "bar")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(rows, cfg.eval.bootstrap_resamples, cfg.train.seed)
    low, high = summary["ci95"]
    print(f"held-out success {summary['success']:.3f} on {summary['tasks']} tasks x "
          f"{cfg.eval.samples_per_task} samples (T = {cfg.eval.temperature}), bootstrap 95% CI "
          f"[{low:.3f}, {high:.3f}]; mean turns {summary['turns']:.2f}")
    for name, value in summary["metrics"].items():
        print(f"  {name}: {value:.3f}")
    print(f"per-task rows: {out}")
    print(json.dumps({"checkpoint": str(checkpoint), **summary}))
    return 0
