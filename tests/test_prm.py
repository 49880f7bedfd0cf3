"""Process reward model: inputs and markers, the two heads against a plain forward pass,
environment-labelled training data, and a PRM trained by ``turnrl prm train`` that ranks
held-out good turns above bad ones (AUC reported and asserted).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
import yaml

from rewards.prm import ProcessRewardModel, pack, prm_input, read_meta
from rewards.prm_data import (BAD_KINDS, gold_actions, labelled_episodes, malformed,
                              perturbed_actions, play_labelled)
from rewards.prm_train import roc_auc
from rollout.trajectory import Trajectory, Turn


def test_roc_auc_hand_values() -> None:
    # Pairs (good, bad): (0.35, 0.1) win, (0.35, 0.4) lose, (0.8, *) win twice -> 3/4.
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.5, 0.5], [1, 0]) == pytest.approx(0.5)  # a tie counts half
    assert roc_auc([0.9, 0.1], [1, 0]) == 1.0
    with pytest.raises(ValueError, match="both labels"):
        roc_auc([0.3, 0.4], [1, 1])


def test_prm_input_markers_and_packing() -> None:
    turns = [Turn(action_ids=[3, 4], action_logprobs=[0.0, 0.0], policy_version=0, observation_ids=[5]),
             Turn(action_ids=[6], action_logprobs=[0.0], policy_version=0)]
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1, 2], turns=turns)
    item = prm_input(traj)
    assert item.ids == [1, 2, 3, 4, 5, 6]
    assert item.markers == [3, 5]  # each turn's last action token
    doubled = prm_input(traj, lambda ids: [i * 10 for i in ids for _ in (0, 1)])
    assert doubled.markers == [7, 11]  # re-encoded segments: markers move with them
    # budget 12: rows of 6 pack two by two; a row longer than the budget goes alone.
    assert pack([item, item, item], 12) == [[0, 1], [2]]
    assert pack([doubled, item], 12) == [[0], [1]]


def test_perturbations_fit_the_turn_budget() -> None:
    rng = random.Random(0)
    gold = ["a", "b", "<answer>c</answer>"]
    out = perturbed_actions(gold, [["x", "y", "<answer>z</answer>"]], 4, 1.0, rng)
    assert len(out) == 4 and out[1:] == gold  # one spare turn: one wrong step, up front
    assert perturbed_actions(gold, [], 3, 1.0, rng) == gold  # no spare turn: gold only
    call = '<tool_call>{"name": "search", "arguments": {"query": "Vedor"}}</tool_call>'
    broken = {malformed(call, random.Random(s)) for s in range(20)}
    assert len(broken) == 3 and call not in broken  # unknown tool, no arguments, cut JSON
    assert malformed("<answer>c</answer>", rng) == "<answer>c"
    assert set(BAD_KINDS) == {"swap", "repeat", "malformed", "no_call"}


def test_env_labels_on_real_episodes(tiny_policy) -> None:
    from transformers import AutoTokenizer

    path, source = tiny_policy
    tok = AutoTokenizer.from_pretrained(path)
    task = source.tasks("train")[0]
    gold = gold_actions(source, task)
    clean = asyncio.run(play_labelled(source, task, tok, gold))
    assert clean.labels == [1] * len(gold)  # new supporting doc, correct answer
    noisy = asyncio.run(play_labelled(source, task, tok, ["I will look that up.", gold[0], gold[0]]))
    assert noisy.labels == [0, 1, 0]  # no call; support found; nothing new
    assert noisy.token_ids()[: len(clean.prompt_ids)] == clean.prompt_ids
    episodes = labelled_episodes(source, source.tasks("train")[:20], tok, bad_step_rate=0.5, seed=0)
    labels = [lab for e in episodes for lab in e.labels]
    assert 0 < sum(labels) < len(labels)  # both labels occur


def test_reward_tokens_head_equals_plain_forward(tiny_policy) -> None:
    path, source = tiny_policy
    prm = ProcessRewardModel.load(path, "reward_tokens", "+", "-")
    episodes = labelled_episodes(source, source.tasks("train")[:3], prm.tokenizer,
                                 bad_step_rate=0.5, seed=1)
    items = [prm_input(e) for e in episodes]
    shared = prm.score(items, token_budget=16384)  # one batch: the common prefix runs once
    alone = prm.score(items, token_budget=1)  # one row per batch: no prefix sharing
    assert sum(map(len, shared)) > len(items)
    for item, probs, single in zip(items, shared, alone):
        assert probs == pytest.approx(single, abs=1e-5)
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([item.ids])).logits[0]
        for m, p in zip(item.markers, probs):
            two = torch.log_softmax(logits[m, [prm.good_id, prm.bad_id]], dim=-1)
            assert p == pytest.approx(two[0].exp().item(), abs=1e-5)  # P(good), two-way softmax


def test_classification_head_and_meta_roundtrip(tiny_policy, tmp_path) -> None:
    path, source = tiny_policy
    prm = ProcessRewardModel.load(path, "classification")  # causal LM path; fresh head
    [episode] = labelled_episodes(source, source.tasks("train")[:1], prm.tokenizer,
                                  bad_step_rate=0.0, seed=0)
    item = prm_input(episode)
    [probs] = prm.score([item], 16384)
    with torch.no_grad():
        logits = prm.model(input_ids=torch.tensor([item.ids])).logits[0, :, 0]
    assert probs == pytest.approx(torch.sigmoid(logits[item.markers]).tolist(), abs=1e-5)
    prm.version = 4
    prm.save(tmp_path / "prm", {"auc": 0.5})
    assert read_meta(tmp_path / "prm") == {"head": "classification", "good_token": "+",
                                           "bad_token": "-", "version": 4, "auc": 0.5}
    again = ProcessRewardModel.load(str(tmp_path / "prm"), "classification")
    assert again.version == 4 and again.score([item], 16384)[0] == pytest.approx(probs, abs=1e-5)
    with pytest.raises(ValueError, match="set prm.head to match"):
        ProcessRewardModel.load(str(tmp_path / "prm"), "reward_tokens")
    with pytest.raises(ValueError, match="single token"):
        ProcessRewardModel(prm.model, prm.tokenizer, "reward_tokens", good_token="excellent step")


@pytest.mark.slow
def test_prm_train_cli_ranks_heldout_turns(tiny_run_config, tmp_path) -> None:
    """``turnrl prm train``: env-labelled episodes from 60 train tasks, 3 epochs; the AUC on
    turns of 40 held-out tasks (never trained on) must be well above chance (0.5). Seen:
    0.86 with seed 0 (seeds 1 and 2 gave 0.79 and 0.76), about 25 s of CPU."""
    from cluster.rewards_cli import main

    out = tmp_path / "prm"
    train = {"num_tasks": 60, "heldout_tasks": 40, "epochs": 3, "lr": 5e-3, "bad_step_rate": 0.8}
    cfg = tiny_run_config([f"rewards.prm={json.dumps({'type': 'model', 'path': str(out), 'train': train})}"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
    torch.manual_seed(0)
    assert main(["prm", "train", str(path)]) == 0
    meta = read_meta(out)
    heldout = meta["heldout"]
    print(f"PRM held-out AUC {heldout['auc']:.3f} over {heldout['turns']} turns "
          f"(mean P(good) good {heldout['mean_good']:.3f}, bad {heldout['mean_bad']:.3f})")
    assert meta["version"] == 1 and meta["head"] == "reward_tokens"
    assert heldout["auc"] > 0.7
    assert heldout["mean_good"] > heldout["mean_bad"]
