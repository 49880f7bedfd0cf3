"""Outcome reward, reward config and PRM transforms: hand-derived values."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from rewards.config import REWARD_SOURCES, IGConfig, OutcomeConfig, RewardsConfig
from envs.base import exact_match, normalize_answer
from rewards.outcome import (
    outcome_reward,
    score_final_text,
    token_f1,
)
from rewards.prm_transforms import apply_prm_transform, clip_transform, delta_transform


# -- normalisation / metrics -------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Eiffel Tower!", "eiffel tower"),  # lower, drop "!", drop "the", collapse
        ("an apple, a pear", "apple pear"),  # both articles and the comma go
        ("Theory", "theory"),  # "the" only as a whole word
        ("  U.S.A.  ", "usa"),  # dots are punctuation: "u.s.a." -> "usa"
        ("the", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match_ignores_case_articles_punctuation() -> None:
    assert exact_match("the Paris.", ["paris"]) is True
    assert exact_match("Paris France", ["london", "paris"]) is False
    assert exact_match(None, ["paris"]) is False and exact_match("paris", []) is False


def test_token_f1_hand_derived() -> None:
    # pred "new york city" (3 tokens), gold "york city" (2): overlap 2.
    # P = 2/3, R = 2/2 = 1, F1 = 2 * (2/3) * 1 / (2/3 + 1) = (4/3) / (5/3) = 0.8
    assert token_f1("New York City", "York city") == pytest.approx(0.8)
    # Bag of words counts multiplicity: pred "a b b" -> [b, b] after article removal ("a"),
    # gold "b c": overlap min(2,1) = 1 -> P = 1/2, R = 1/2, F1 = 0.5
    assert token_f1("a b b", "b c") == pytest.approx(0.5)
    assert token_f1("x", "y") == 0.0
    # Empty after normalisation: 1 only if both empty (SQuAD v2 rule).
    assert token_f1("the", "an") == 1.0
    assert token_f1("the", "paris") == 0.0


# -- outcome_reward ----------------------------------------------------------------------
def test_outcome_max_over_aliases() -> None:
    # Alias "NYC" gives EM 1; alias "New York City" gives F1 with pred "nyc" 0; max -> em=1, f1=1.
    s = outcome_reward("nyc", ["New York City", "NYC"])
    assert (s.reward, s.em, s.f1, s.well_formed) == (1.0, 1.0, 1.0, True)


def test_outcome_f1_metric_takes_best_alias_independently() -> None:
    # pred "york city": alias1 "new york city" F1 = 2*(1)*(2/3)/(1+2/3) = 0.8; alias2 "big
    # apple" F1 = 0. EM = 0 everywhere. reward = max F1 = 0.8.
    s = outcome_reward("York City", ["New York City", "big apple"], metric="f1")
    assert s.reward == pytest.approx(0.8)
    assert s.em == 0.0 and s.f1 == pytest.approx(0.8)


@pytest.mark.parametrize(("answer", "balanced"), [(None, True), ("paris", False)])
def test_format_penalty(answer: str | None, balanced: bool) -> None:
    s = outcome_reward(answer, ["paris"], metric="f1", format_penalty=-2.0, balanced=balanced)
    assert (s.reward, s.em, s.f1, s.well_formed) == (-2.0, 0.0, 0.0, False)


def test_empty_gold_raises_with_advice() -> None:
    with pytest.raises(ValueError, match="at least one gold answer"):
        outcome_reward("x", [])


def test_score_final_text_parses_tags() -> None:
    assert score_final_text("I think <answer>The Paris</answer>", ["paris"]).reward == 1.0
    # Unbalanced: one <answer> open, two closes -> penalty.
    s = score_final_text("<answer>paris</answer></answer>", ["paris"], format_penalty=-1.0)
    assert s.reward == -1.0 and not s.well_formed
    s = score_final_text("no answer here", ["paris"], format_penalty=-1.0)
    assert s.reward == -1.0


def test_score_final_text_reads_the_policy_chat_format() -> None:
    # Qwen3 reasons in <think> first: an answer written while reasoning is not the answer.
    text = "<think>maybe <answer>Paris</answer>, no</think><answer>Rome</answer>"
    assert score_final_text(text, ["paris"], chat_format="qwen3").reward == 0.0
    assert score_final_text(text, ["rome"], chat_format="qwen3").reward == 1.0
    assert score_final_text(text, ["paris"]).reward == 1.0  # Hermes has no reasoning block: the first answer


def test_reward_service_scores_in_the_chat_format_it_is_built_with() -> None:
    import asyncio

    from rewards.service import RewardService
    from tests.redis_fixture import make_group

    def scored(service: RewardService) -> float:
        group = make_group("g", trajectories=1, text="<think><answer>Paris</answer></think><answer>Rome</answer>")
        group.trajectories[0].gold_answers = ["rome"]
        return asyncio.run(service.score_group(group)).trajectories[0].outcome

    assert scored(RewardService(RewardsConfig(), None, chat_format="qwen3")) == 1.0
    assert scored(RewardService(RewardsConfig(), None)) == 0.0  # Hermes reads the first answer, Paris


# -- config --------------------------------------------------------------------------------
def test_config_sources_match_schema_and_import_no_torch() -> None:
    from rollout.trajectory import REWARD_SOURCES as schema_sources

    assert REWARD_SOURCES == schema_sources
    # config modules import only pydantic: importing rewards.config alone must not pull torch.
    import subprocess

    code = "import sys, rewards.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rewards_config_weights() -> None:
    cfg = RewardsConfig(ig=IGConfig(weight=0.3), weights={"prm": 0.5})
    assert cfg.weight("outcome") == 1.0  # section default
    assert cfg.weight("ig") == 0.3  # section value
    assert cfg.weight("prm") == 0.5  # dict value
    assert cfg.weight("env") == 1.0  # nothing set
    assert cfg.on_missing == "mask_turn"
    with pytest.raises(ValidationError, match="'prn'"):
        RewardsConfig(weights={"prn": 1.0})
    with pytest.raises(ValidationError, match="set it in one place"):
        RewardsConfig(outcome=OutcomeConfig(weight=0.2), weights={"outcome": 0.7})
    with pytest.raises(ValidationError):
        OutcomeConfig(metrc="f1")  # extra="forbid" catches typos


def test_every_config_field_has_docstring() -> None:
    import ast
    import inspect

    import rewards.config as mod

    tree = ast.parse(inspect.getsource(mod))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and node.target.id != "model_config":
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                    f"{cls.name}.{node.target.id} has no docstring"
                )


# -- PRM transforms ------------------------------------------------------------------------
def test_clip_caps_at_bound() -> None:
    # min(r, 0): [0.7, -0.2, 0.0] -> [0, -0.2, 0]; None stays None.
    assert clip_transform([0.7, -0.2, 0.0, None]) == [0.0, -0.2, 0.0, None]
    # Paper form min(r - 0.5, 0): 0.7 -> 0, 0.2 -> -0.3.
    assert clip_transform([0.7, 0.2], shift=0.5) == pytest.approx([0.0, -0.3])
    assert clip_transform([0.7, 0.2], bound=0.5) == pytest.approx([0.5, 0.2])


def test_delta_telescopes() -> None:
    r = [0.9, 0.6, 0.8]
    # [0.9-0.6, 0.6-0.8, 0.8] = [0.3, -0.2, 0.8]; sum = 0.9 = r_1.
    d = delta_transform(r)
    assert d == pytest.approx([0.3, -0.2, 0.8])
    assert sum(d) == pytest.approx(r[0])
    assert delta_transform([0.5, None, 0.2]) == [None, None, 0.2]
    assert delta_transform([]) == []


def test_unknown_transform_lists_known() -> None:
    assert apply_prm_transform("delta", [1.0, 0.5]) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="clip, delta, none"):
        apply_prm_transform("dleta", [1.0])
