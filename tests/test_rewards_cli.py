"""``turnrl rewards score CONFIG --input --output``: logged trajectories in, the same
trajectories with every configured source scored out (the schema's JSONL), in-process."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from cluster.rewards_cli import main
from rollout.trajectory import read_jsonl, write_jsonl


@pytest.fixture(scope="module")
def logged(tiny_policy, tmp_path_factory):
    """Two groups of real episodes (gold, and a wrong search first), saved as JSONL."""
    from transformers import AutoTokenizer

    from rewards.prm_data import gold_actions, play_labelled

    path, source = tiny_policy
    tok = AutoTokenizer.from_pretrained(path)
    tasks = source.tasks("train")
    trajs = []
    for i in (7, 8):
        gold = gold_actions(source, tasks[i])
        for actions in (gold, [gold_actions(source, tasks[i + 2])[0], *gold]):
            traj = asyncio.run(play_labelled(source, tasks[i], tok, actions, group_id=f"g{i}"))
            traj.turns[0].rewards["ig"] = 123.0  # a stale score the CLI must replace
            trajs.append(traj)
    out = tmp_path_factory.mktemp("logged") / "trajectories.jsonl"
    write_jsonl(out, trajs)
    return path, out, trajs


def write_config(cfg, path) -> str:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
    return str(path)


def test_score_round_trip(logged, tiny_run_config, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewards.config import IGConfig
    from rewards.ig_scorer import IGScorer

    policy, inp, sent = logged
    judge = {"type": "judge", "backend": "callable", "function": "rewards.judge:format_judge"}
    cfg = tiny_run_config(["rewards.ig={}", "rewards.match={mode: greedy}",
                           f"rewards.prm={json.dumps(judge)}"])
    out = tmp_path / "scored.jsonl"
    assert main(["rewards", "score", write_config(cfg, tmp_path / "c.yaml"),
                 "--input", str(inp), "--output", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trajectories"] == 4 and summary["missing"] == {}
    scored = list(read_jsonl(out))
    assert [t.trajectory_id for t in scored] == [t.trajectory_id for t in sent]  # input order
    model = AutoModelForCausalLM.from_pretrained(policy, attn_implementation="sdpa")
    ig = IGScorer(model.eval(), AutoTokenizer.from_pretrained(policy), IGConfig())
    for k, (before, after) in enumerate(zip(sent, scored)):
        n = len(after.turns)
        assert after.turns[-1].rewards["outcome"] == 1.0 and after.outcome == 1.0
        assert [t.rewards["env"] for t in after.turns] == [t.rewards["env"] for t in before.turns]
        [ref] = ig.score_per_turn([before])
        assert [t.rewards["ig"] for t in after.turns[:-1]] == pytest.approx(ref.ig, abs=1e-5)
        # greedy matching: the gold searches match exactly (1.0) and the answer turn gets F1
        # (1.0); a wrong first search (odd k) has similarity 2/3 to each gold call, but the
        # exact matches take them first -> unmatched -> 0.
        first = [0.0] if k % 2 else [1.0]
        assert [t.rewards["match"] for t in after.turns] == first + [1.0] * (n - 1)
        assert [t.rewards["prm"] for t in after.turns] == [1.0] * n  # all well formed
        assert len(after.reward_details["prm"]["judgements"]) == n
    # scoring the scored file again gives the same numbers (idempotent)
    again = tmp_path / "again.jsonl"
    assert main(["rewards", "score", str(tmp_path / "c.yaml"), "--input", str(out),
                 "--output", str(again)]) == 0
    for a, b in zip(read_jsonl(out), read_jsonl(again)):
        assert [t.rewards for t in a.turns] == [t.rewards for t in b.turns]


def test_cli_errors_name_the_problem(logged, tiny_run_config, tmp_path, capsys) -> None:
    policy, inp, _ = logged
    cfg_path = write_config(tiny_run_config(["rewards.ig={}"]), tmp_path / "c.yaml")
    assert main(["rewards", "score", cfg_path, "--input", str(tmp_path / "none.jsonl"),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert main(["rewards", "score", cfg_path, "--set", "rewards.igg={}", "--input", str(inp),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "rewards.igg: unknown key" in capsys.readouterr().err
    assert main(["prm", "train", cfg_path]) == 2
    assert "rewards.prm with type: model" in capsys.readouterr().err
