"""LoRA runs (``learner.lora``, ``learner/lora.py``): only the adapters train, under DeepSpeed
ZeRO 0 and 2; the KL reference is the base (adapters disabled); the published weights are
the merge; checkpoints hold the adapter and name the base; ``turnrl models merge``, ``turnrl
eval``'s loader and ``policy.path`` load base + adapter.

One module fixture builds the learners (the DeepSpeed part, in this process, gloo); the
other tests read what it left."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.config import LearnerConfig, LoRAConfig
from rollout.trajectory import Trajectory, Turn
from tests.dist_env import own_process_group


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=300, max_position_embeddings=64))


# -- config and the pure parts (no DeepSpeed) ----------------------------------------------

def test_config_refuses_bad_values_naming_the_field() -> None:
    for bad, needle in (({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"), ({"target_modules": []}, "target_modules"),
                        ({"target_modules": ["q_proj", "q_proj"]}, "learner.lora.target_modules")):
        with pytest.raises(ValidationError, match=needle):
            LoRAConfig(**bad)
    with pytest.raises(ValidationError, match="learner.lora with learner.zero_stage=3"):
        LearnerConfig(lora={}, zero_stage=3)
    assert LearnerConfig(lora={}).lora.target_modules == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_a_target_matching_nothing_fails_listing_the_models_linear_modules() -> None:
    from learner.lora import wrap

    with pytest.raises(ValueError) as err:
        wrap(_tiny_llama(), LoRAConfig(target_modules=["q_proj", "query_key_value"]))
    msg = str(err.value)
    assert msg.startswith("learner.lora.target_modules: ['query_key_value'] match no linear module")
    assert "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in msg


def test_the_driver_checks_targets_against_the_policy_folder(tiny_policy) -> None:
    from learner.lora_check import check_policy  # the driver's: in a child process

    check_policy(tiny_policy[0], LoRAConfig())  # every default target is a layer of the tiny Llama
    with pytest.raises(ValueError, match=r"learner.lora.target_modules: \['c_attn'\] match no linear module"):
        check_policy(tiny_policy[0], LoRAConfig(target_modules=["c_attn"]))
    with pytest.raises(RuntimeError, match="failed"):  # no policy there: not a refusal of the targets
        check_policy(tiny_policy[0] + "-missing", LoRAConfig())


def test_merged_state_is_peft_merge_and_unload() -> None:
    """The weights the learner publishes equal peft's own merge, key for key."""
    from learner.lora import merged_state, wrap

    cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    model = wrap(_tiny_llama(), cfg)
    with torch.no_grad():  # a trained adapter: B is 0 when peft creates it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    mine = merged_state(model.state_dict(), cfg)
    plain = _tiny_llama().state_dict()
    theirs = model.merge_and_unload().state_dict()
    assert set(mine) == set(theirs) == set(plain)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=1e-6)
    moved = [k for k in plain if not torch.equal(mine[k], plain[k])]
    assert sorted(moved) == [f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("mlp.down_proj", "self_attn.q_proj")]


# -- DeepSpeed learners -------------------------------------------------------------------

def _trajectories() -> list[Trajectory]:
    """2 groups x 2 rollouts of 2 turns; outcomes differ within each group (GRPO: non-zero
    advantages)."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for g in range(2):
        for r in range(2):
            turns = [Turn(action_ids=torch.randint(5, 200, (4,), generator=gen).tolist(), action_logprobs=[-1.0] * 4,
                          policy_version=0, observation_ids=torch.randint(5, 200, (5,), generator=gen).tolist() if t == 0 else [])
                     for t in range(2)]
            trajs.append(Trajectory(trajectory_id=f"{g}{r}", task_id=f"t{g}", group_id=f"g{g}", prompt_ids=[5, 6, 7, 8 + g],
                                    turns=turns, outcome=float(r)))
    return trajs


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tiny_policy, tmp_path_factory):
    """For ZeRO 0 and 2: a LoRA learner's counts, weights before and after two optimizer
    steps (2 PPO epochs: the second moves A too, whose gradient is 0 while B is) and its
    logits with and without the adapter; the ZeRO 2 learner saves a checkpoint, and a learner
    resumed from it publishes (``resumed``: its weights and what it published)."""
    from learner.ports import LocalLearnerPorts
    from learner.worker import LearnerWorker
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    policy, out = tiny_policy[0], {}
    ports = LocalLearnerPorts(InProcessReplayStore(ReplayConfig(), 2))
    tokens = torch.tensor([[5, 6, 7, 8, 20, 30, 40, 50, 60]])
    with own_process_group():
        for stage in (0, 2):
            # ZeRO 0 publishes the adapter alone (the default), ZeRO 2 the merged weights
            lora = {"rank": 4, "alpha": 16.0, "publish": "adapter" if stage == 0 else "merged"}
            cfg = LearnerConfig(batch_groups=2, micro_batch_size=8, lr=5e-2, zero_stage=stage, ppo_epochs=2,
                                loss={"type": "ppo", "kl_coef": 0.1}, lora=lora)
            run_dir = tmp_path_factory.mktemp(f"lora_zero{stage}")
            ports.published = None
            worker = LearnerWorker(cfg, policy, str(run_dir), ports, group_size=2, temperature=1.0)
            module = worker.ds_engine.module
            opt = getattr(worker.ds_engine.optimizer, "optimizer", worker.ds_engine.optimizer)
            res = {"cfg": cfg, "before": _snapshot(module), "metrics": worker._update(_trajectories()),
                   "trainable": {n: p.numel() for n, p in module.named_parameters() if p.requires_grad},
                   "optimizer_numel": sum(p.numel() for g in opt.param_groups for p in g["params"]),
                   "first_published": ports.published}
            res["after"] = _snapshot(module)
            module.eval()
            with torch.no_grad():
                res["logits"] = module(input_ids=tokens).logits
                with module.disable_adapter():
                    res["base_logits"] = module(input_ids=tokens).logits
            out[stage] = res
            if stage == 2:
                worker.step, worker.version = 1, 1
                res["checkpoint"] = Path(worker.save_checkpoint())
                again = LearnerWorker(cfg, policy, str(run_dir), ports, group_size=2, temperature=1.0, resume=True)
                res["resumed"] = _snapshot(again.ds_engine.module), ports.published
            del worker
    return policy, tokens, out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_only_adapters_train_and_the_base_stays_bit_for_bit(trained, stage) -> None:
    _, _, runs = trained
    res = runs[stage]
    # 2 layers x (q,k,v,o: 64 -> 64; gate, up: 64 -> 128; down: 128 -> 64), rank 4: r * (in + out)
    lora_count = 2 * (4 * 4 * (64 + 64) + 3 * 4 * (64 + 128))
    assert sum(res["trainable"].values()) == lora_count == 8704
    assert all(".lora_A." in n or ".lora_B." in n for n in res["trainable"])
    assert res["optimizer_numel"] == lora_count  # what reaches the optimizer, under ZeRO's flattening too
    before, after = res["before"], res["after"]
    base = [k for k in before if ".lora_" not in k]
    assert base and all(torch.equal(before[k], after[k]) for k in base)
    for kind in ("lora_A", "lora_B"):
        moved = [k for k in before if f".{kind}." in k and not torch.equal(before[k], after[k])]
        assert len(moved) == 14, kind  # every adapted layer's A and B
    assert res["metrics"]["loss/updates"] == 2.0


@pytest.mark.slow
def test_a_learner_publishing_its_adapter_publishes_version_0_as_it_starts(trained) -> None:
    """``publish: adapter``: engines serve a run's requests only with its adapter loaded, so
    a fresh learner publishes it at once (B = 0: the base's outputs), the adapter's tensors
    alone under the base's module names; one publishing merged weights waits for its first step."""
    from learner.lora import adapter_state

    _, _, runs = trained
    version, published = runs[0]["first_published"]
    assert version == 0 and set(published) == set(adapter_state(runs[0]["before"]))
    assert len(published) == 28 and sum(t.numel() for t in published.values()) == 8704
    q_b = "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert not published[q_b].any()  # peft starts B at 0
    assert runs[2]["first_published"] is None


@pytest.mark.slow
def test_the_kl_reference_is_the_base(trained) -> None:
    """B starts at 0, so the first step's policy is the base: its KL is 0; after training the
    reference (adapters disabled) still gives the base model's own logits."""
    from transformers import AutoModelForCausalLM

    policy, tokens, runs = trained
    plain = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    with torch.no_grad():
        want = plain(input_ids=tokens).logits
    for res in runs.values():
        torch.testing.assert_close(res["base_logits"], want, rtol=0, atol=1e-5)
        assert not torch.allclose(res["logits"], want, atol=1e-3)  # the adapter moved the policy
        assert res["metrics"]["loss/kl"] > 0  # the second epoch's policy differs from the base


@pytest.mark.slow
def test_checkpoint_holds_the_adapter_and_names_the_base(trained, tmp_path) -> None:
    from safetensors.torch import load_file

    policy, _, runs = trained
    ckpt = runs[2]["checkpoint"]
    names = sorted(p.name for p in ckpt.iterdir())
    assert {"adapter_model.safetensors", "adapter_config.json", "turnrl_lora.json", "tokenizer.json"} <= set(names)
    assert "model.safetensors" not in names and "config.json" not in names
    marker = json.loads((ckpt / "turnrl_lora.json").read_text())
    assert marker["base"] == str(Path(policy).resolve())
    assert marker["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": LoRAConfig().target_modules,
                              "publish": "merged"}
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert len(adapter) == 28 and all(".lora_" in k for k in adapter)
    trained_b = runs[2]["after"]["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    torch.testing.assert_close(adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                               trained_b, rtol=0, atol=0)


@pytest.mark.slow
def test_a_resumed_learner_continues_from_the_adapter_and_publishes_the_merge(trained) -> None:
    from learner.lora import merged_state

    _, _, runs = trained
    res = runs[2]
    weights, (version, published) = res["resumed"]
    assert set(weights) == set(res["after"])
    for key, value in res["after"].items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0)
    assert version == 1 and not any(".lora_" in k or "base_model" in k for k in published)
    # DeepSpeed's module state in the checkpoint is the adapter (8704 floats), not the base;
    # DeepSpeed drops frozen parameters by name, so the tied output head's second name stays
    module_states = torch.load(res["checkpoint"].parents[1] / "ds_checkpoint" / "step_000001" / "mp_rank_00_model_states.pt",
                               weights_only=False)["module"]
    assert sum(v.numel() for k, v in module_states.items() if ".lora_" in k) == 8704
    assert [k for k in module_states if ".lora_" not in k] == ["base_model.model.lm_head.weight"]
    want = merged_state(res["after"], res["cfg"].lora)
    assert set(published) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(published[key], value, rtol=0, atol=0)


@pytest.mark.slow
def test_merge_export_eval_loader_and_policy_path_give_the_trained_logits(trained, tmp_path) -> None:
    """``turnrl models merge`` writes a plain folder whose logits are the trained adapter's;
    ``turnrl eval``'s loader and ``policy.path`` give a folder with the same logits."""
    from transformers import AutoModelForCausalLM

    from cluster.eval_cli import load_path, resolve_checkpoint
    from cluster.models_cli import main as models_main
    from learner.bootstrap import ensure_policy
    from learner.config import PolicyConfig

    _, tokens, runs = trained
    ckpt = runs[2]["checkpoint"]
    out = tmp_path / "merged"
    assert models_main(["merge", str(ckpt), str(out)]) == 0
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    eval_folder = load_path(resolve_checkpoint(str(ckpt)))
    assert eval_folder == ckpt / "merged"
    assert ensure_policy(PolicyConfig(path=str(ckpt)), None, None) == eval_folder  # cached: the same folder
    for folder in (out, eval_folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=tokens).logits, runs[2]["logits"], rtol=0, atol=1e-4)
    assert models_main(["merge", str(out), str(tmp_path / "again")]) == 2  # not a LoRA checkpoint


@pytest.mark.slow
def test_the_engine_serves_the_published_merge(trained) -> None:
    """The HF engine after loading what the learner publishes decodes greedily what a plain
    model merged by peft from the same adapter does."""
    from learner.lora import merged_folder, merged_state
    from rollout.engines import local_client
    from rollout.config import HFEngineConfig
    from rollout.engines.transport import InMemoryWeights
    from rollout.engines.base import SamplingParams

    policy, _, runs = trained
    res = runs[2]
    greedy, prompt = SamplingParams(temperature=0.0, max_new_tokens=24), [5, 6, 7, 8, 20]
    published = local_client(HFEngineConfig(), policy, seed=0)
    merged = local_client(HFEngineConfig(), str(merged_folder(res["checkpoint"])), seed=0)

    async def tokens(client) -> list[int]:
        return (await client.generate(prompt, greedy)).token_ids

    base_tokens = asyncio.run(tokens(published))
    asyncio.run(published.update_weights(published.version + 1, InMemoryWeights(merged_state(res["after"], res["cfg"].lora))))
    got, want = asyncio.run(tokens(published)), asyncio.run(tokens(merged))
    assert got == want
    assert got != base_tokens  # the adapter changed what the policy says
    for client in (published, merged):
        asyncio.run(client.engine.close())
