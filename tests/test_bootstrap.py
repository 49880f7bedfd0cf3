"""The builtin policy's warm start: where its demonstrations come from and how its cache is keyed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.registry import make_task_source
from learner.bootstrap import demo_env_config, ensure_policy


def test_sft_env_replaces_keys_of_the_run_env_and_names_bad_ones(tiny_run_config) -> None:
    cfg = tiny_run_config(["policy.sft.env={seed: 3, num_train_tasks: 20}"])
    demo = demo_env_config(cfg.policy, cfg.env)
    assert (demo.seed, demo.num_train_tasks, demo.num_entities) == (3, 20, cfg.env.num_entities)
    assert demo_env_config(tiny_run_config().policy, cfg.env) is None
    bad = tiny_run_config(["policy.sft.env={seeed: 3}"])
    with pytest.raises(ValueError, match=r"policy\.sft\.env.*seeed"):
        demo_env_config(bad.policy, bad.env)


def test_warm_start_on_another_world_trains_on_its_demonstrations(tiny_run_config) -> None:
    # 20 training tasks in the demonstration world vs 300 in the run's: the SFT stats tell
    # which source the demonstrations came from; the cache key separates the two policies
    cfg = tiny_run_config(["policy.sft.env={seed: 3, num_train_tasks: 20}", "policy.sft.steps=2"])
    source = make_task_source(cfg.env)
    path = Path(ensure_policy(cfg.policy, cfg.env, source, show_progress=False))
    stats = json.loads((path / "turnrl_bootstrap.json").read_text())
    assert stats["sft_demos"] == 20.0
    plain = tiny_run_config(["policy.sft.steps=2"])
    other = Path(ensure_policy(plain.policy, plain.env, source, show_progress=False))
    assert other != path
    assert json.loads((other / "turnrl_bootstrap.json").read_text())["sft_demos"] == 200.0


def test_guess_fraction_turns_a_seeded_share_of_demonstrations_into_guesses(tiny_run_config) -> None:
    from learner.sft import demonstrations

    cfg = tiny_run_config(["policy.sft.num_demos=20", "policy.sft.guess_fraction=0.25"])
    source = make_task_source(cfg.env)
    demos = demonstrations(source, cfg.policy.sft)
    golds = {t.gold_answers[0] for t in source.tasks("train")[:20]}
    guessed = [(task, demo) for task, demo in demos if len(demo) == 1]
    assert len(demos) == 20 and len(guessed) == 5  # round(0.25 * 20)
    for task, demo in guessed:  # an answer at once, another task's gold, never this one's
        assert demo[0]["role"] == "assistant" and "tool_call" not in demo[0]["content"]
        guess = demo[0]["content"].removeprefix("<answer>").removesuffix("</answer>")
        assert guess in golds and guess not in task.gold_answers
    for task, demo in demos:
        if len(demo) > 1:  # the rest are the full search-then-answer replays
            assert demo == source.demonstration(task)
    again = demonstrations(source, cfg.policy.sft)
    assert [d for _, d in again] == [d for _, d in demos]  # the choice is seeded
    none = demonstrations(source, tiny_run_config(["policy.sft.num_demos=20"]).policy.sft)
    assert all(len(d) > 1 for _, d in none)


def test_guess_fraction_needs_two_different_answers_to_guess_from() -> None:
    from envs.base import Task
    from learner.sft import guesses

    tasks = [Task(task_id=f"t{i}", messages=[], gold_answers=["same"]) for i in range(4)]
    with pytest.raises(ValueError, match=r"policy\.sft\.guess_fraction"):
        guesses(tasks, 0.5, seed=0)
    assert guesses(tasks, 0.0, seed=0) == {}


def test_split_digits_gives_every_digit_its_own_token_in_the_saved_tokenizer(policy_cache) -> None:
    from transformers import PreTrainedTokenizerFast

    from cluster.config import load_config

    def tokenizer(overrides: list[str]) -> PreTrainedTokenizerFast:
        # tool use: prices, quantities and tool outputs give BPE digit runs to merge
        cfg = load_config(None, ["env.type=tool_use", "env.num_train_tasks=40", "env.num_heldout_tasks=5",
                                 "policy.tiny.vocab_size=600", "policy.sft.enabled=false",
                                 f"policy.cache_dir={policy_cache}", *overrides])
        path = Path(ensure_policy(cfg.policy, cfg.env, make_task_source(cfg.env), show_progress=False))
        return PreTrainedTokenizerFast.from_pretrained(path)  # reloaded through the real path

    def digit_runs(tok: PreTrainedTokenizerFast) -> list[str]:
        return [t for t in tok.get_vocab() if len(t) > 1 and t.isdigit()]

    split, merged = tokenizer(["policy.tiny.split_digits=true"]), tokenizer([])
    ids = split("born 1843.25", add_special_tokens=False)["input_ids"]
    assert split.convert_ids_to_tokens(ids)[-7:] == ["1", "8", "4", "3", ".", "2", "5"]
    assert digit_runs(split) == []
    assert len(digit_runs(merged)) > 10  # with the option off, BPE merges frequent digit runs


def test_warm_start_probe_reports_success_and_imitation_by_turn(tiny_run_config, tiny_policy, capsys) -> None:
    """bench/warm_start.py on the tiny search-QA policy: counts add up, turn by turn."""
    import re

    from bench.warm_start import main
    from tests.conftest import TINY_OVERRIDES

    cache = str(Path(tiny_policy[0]).parent)
    main(["--tasks", "3", "--samples", "2", *[a for o in TINY_OVERRIDES for a in ("--set", o)],
          "--set", f"policy.cache_dir={cache}", "--set", "rollout.max_new_tokens=32"])
    out = capsys.readouterr().out
    assert f"policy {tiny_policy[0]} ready" in out  # the cached warm start, not a rebuilt one
    for split in ("heldout", "train"):
        wins, total = map(int, re.search(rf"{split}: success (\d+)/(\d+)", out).groups())
        assert total == 6 and 0 <= wins <= 6
    by_turn = dict(re.findall(r"(\d+): (\d+/\d+)", out.split("by turn:")[1]))
    source = tiny_policy[1]
    turns = [sum(m["role"] == "assistant" for m in source.demonstration(t)) for t in source.tasks("train")[:3]]
    # every demonstration has a turn 0; later turn indices only as many as demonstrations reach
    assert by_turn["0"].endswith("/3")
    for t, frac in by_turn.items():
        hit, tried = map(int, frac.split("/"))
        assert tried == sum(n > int(t) for n in turns) and 0 <= hit <= tried


def test_a_policy_another_process_finished_meanwhile_is_kept(tmp_path) -> None:
    """Two processes sharing a policy cache (the suite's two workers): the one finishing second
    keeps the first's folder, which runs may be reading, and drops its own."""
    from learner.bootstrap import _cached

    final = tmp_path / "policy"

    def build_racing(tmp: Path) -> None:  # the other process completes ``final`` during this build
        final.mkdir()
        (final / "turnrl_bootstrap.json").write_text('{"by": "first"}')
        (tmp / "turnrl_bootstrap.json").write_text('{"by": "second"}')

    assert _cached(final, build_racing) == final
    assert json.loads((final / "turnrl_bootstrap.json").read_text()) == {"by": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # the second build's folder is gone
    assert _cached(final, lambda tmp: pytest.fail("a complete policy is built again")) == final


def test_an_empty_mcp_list_leaves_a_warm_starts_cache_key_as_it_was() -> None:
    """Environments gained `mcp` (default []): policies cached before keep their keys (a changed
    key re-ran the credit matrix's SmolLM2 warm start); listed servers change the prompts' tools,
    so they change the key."""
    import json

    from envs.config import SearchQAConfig
    from learner.bootstrap import env_key

    plain = SearchQAConfig(num_entities=200)
    assert "mcp" not in json.loads(env_key(plain)) and env_key(plain) == plain.model_dump_json(exclude={"mcp"})
    served = SearchQAConfig(num_entities=200, mcp=[{"name": "time", "command": "python"}])
    assert json.loads(env_key(served))["mcp"][0]["name"] == "time" and env_key(served) != env_key(plain)


def test_a_warm_start_built_for_a_driver_runs_in_a_child_that_gives_its_memory_back(tmp_path) -> None:
    """The driver's policy build (``ensure_policy_apart``): a tiny policy converted and warm
    started in a child process; the calling process never loads torch and stays small, the
    folder is the one ``ensure_policy`` gives, and a bad config raises here naming the field."""
    import subprocess
    import sys

    from conftest import ROOT, TINY_OVERRIDES

    code = f"""
import json, sys
from cluster.config import load_config
from learner.bootstrap import ensure_policy_apart
cfg = load_config(None, {[*TINY_OVERRIDES, "policy.sft.steps=5", f"policy.cache_dir={tmp_path}"]!r})
path = ensure_policy_apart(cfg.policy, cfg.env, show_progress=False)
try:
    ensure_policy_apart(cfg.policy.model_copy(update={{"path": "builtin:nope"}}), cfg.env, show_progress=False)
    refused = ""
except ValueError as exc:
    refused = str(exc)
# VmHWM: this process's peak RSS since its exec (getrusage's maxrss carries the forking parent's over)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"path": str(path), "torch": "torch" in sys.modules, "refused": refused,
                  "max_rss_mb": peak / 1024}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["path"], "turnrl_bootstrap.json").is_file() and Path(got["path"]).parent == tmp_path
    assert got["torch"] is False and got["max_rss_mb"] < 250, got  # the SFT's memory was the child's
    assert "policy.path: unknown builtin 'builtin:nope'" in got["refused"]
