"""The pool learner (learner.adapter_slots, learner.pool_step, learner.pool) on a tiny real Llama:
a slot trains as a peft LoRA adapter with AdamW does; several tenants' micro-batches fused
through one base pass give every tenant the gradient of its batch alone (1e-5 relative) and, K
steps on, its adapter and optimizer state (fp32, to 1% of one Adam step); tenants on the pool
learner end where their own DeepSpeed learners do; a non-finite gradient skips its own tenant's
step only; rows routed to no slot see the base model, a slot's rows its merged weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from bench.tiny_llama import build_tiny_llama
from learner.adapter_slots import SlotSettings, SlotTable
from learner.batching import TokenBatch
from learner.losses.config import PPOLossConfig
from learner.pool_step import TenantStep, fused_steps

TARGETS = ["q_proj", "v_proj", "down_proj"]
TEXT = ["the pool learner trains every tenant's adapter on one base", "rows go through their own slot"] * 20


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    model, tok = build_tiny_llama(Path(tmp_path_factory.mktemp("pool")), TEXT, vocab=300, hidden=32, layers=2,
                                  max_positions=256, initializer_range=0.2)
    return model.float(), tok


def token_batch(seed: int, rows: int, width: int, vocab: int, nan: bool = False) -> TokenBatch:
    """Rows of random tokens, right-padded to various lengths; the second half of each row's
    tokens are actions with a random advantage per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    ids = torch.randint(2, vocab, (rows, width), generator=g)
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = ids * attn
    loss_mask = torch.zeros(rows, width - 1)
    for r, n in enumerate(lengths.tolist()):
        loss_mask[r, n // 2:n - 1] = 1.0
    adv = torch.randn(rows, 1, generator=g).expand(rows, width - 1).clone() * loss_mask
    if nan:
        adv[0, :] = float("nan")
    turn_ids = torch.where(loss_mask > 0, torch.arange(rows)[:, None].expand(rows, width - 1), -1)
    return TokenBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, behaviour=torch.zeros(rows, width - 1),
                      advantages=adv, turn_ids=turn_ids)


TENANTS = {  # different ranks, learning rates, losses, micro-batch sizes and temperatures
    "a": (SlotSettings(rank=4, alpha=8, lr=1e-2, seed=1), PPOLossConfig(), 2, 1.0),
    "b": (SlotSettings(rank=8, alpha=8, lr=5e-3, seed=2, warmup_steps=2), PPOLossConfig(agg="seq-mean-token-mean"), 3, 1.0),
    "c": (SlotSettings(rank=2, alpha=4, lr=2e-2, seed=3, grad_clip=0.05), PPOLossConfig(clip_high=0.28), 4, 0.7),
    "d": (SlotSettings(rank=4, alpha=16, lr=1e-2, seed=4, weight_decay=0.1), PPOLossConfig(tis="none"), 5, 1.0),
}


def steps_for(k: int, vocab: int, tenants=TENANTS, nan: str | None = None) -> list[TenantStep]:
    return [TenantStep(name, token_batch(100 * k + i, 5, 12 + 3 * i, vocab, nan=name == nan), loss, mbs, temp)
            for i, (name, (_, loss, mbs, temp)) in enumerate(tenants.items())]


def table_with(model, tenants=TENANTS) -> SlotTable:
    table = SlotTable(copy.deepcopy(model), TARGETS)
    for name, (settings, *_rest) in tenants.items():
        table.attach(name, settings)
    return table


STEP_SHARE = 0.01
"""fp32 parameters after K Adam steps agree to 1% of one step (``lr``, the most Adam moves a
parameter a step): batch composition changes the gradient sums' rounding (~1e-7 relative,
checked tightly before any step below), and Adam's normalised step turns a rounding difference
in a gradient near its ``eps`` (1e-8) into up to a few thousandths of a step. Measured: ~1e-6
typically, 7e-5 once at lr 2e-2 (0.35% of a step)."""


def tolerance(slot) -> float:
    return STEP_SHARE * slot.settings.lr


def assert_same_slot(x, y, atol: float | None = None) -> None:
    atol = tolerance(x) if atol is None else atol
    assert x.step == y.step and x.skipped == y.skipped
    for key, t in x.adapter_state().items():
        torch.testing.assert_close(t, y.adapter_state()[key], atol=atol, rtol=0)
    for (pa, sa), (pb, sb) in zip(x.optimizer.state.items(), y.optimizer.state.items()):
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=atol, rtol=0)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], atol=atol, rtol=0)


def test_fused_steps_leave_every_tenant_as_training_it_alone(base) -> None:
    model, tok = base
    fused, alone = table_with(model), table_with(model)
    for k in range(3):
        steps = steps_for(k, len(tok))
        assert fused_steps(fused, steps, tok.pad_token_id) == dict.fromkeys(TENANTS, True)
        for step in steps:
            assert fused_steps(alone, [step], tok.pad_token_id) == {step.slot: True}
    for name in TENANTS:
        assert fused.slots[name].step == 3
        assert_same_slot(fused.slots[name], alone.slots[name])
    moved = fused.slots["a"].adapter_state()  # and training moved them: B is no longer zero
    assert all(float(t.abs().max()) > 0 for key, t in moved.items() if key.endswith("lora_B.weight"))


def test_fused_gradients_equal_each_tenant_alone(base) -> None:
    # the proof before any optimizer step: one fused pass of three tenants' micro-batches
    # leaves in each slot the gradient its micro-batch alone gives
    from learner.pool_step import fused_pass

    model, tok = base
    fused, alone = table_with(model), table_with(model)
    steps = [s for s in steps_for(0, len(tok)) if s.temperature == 1.0]
    mbs = [s.micro_batches()[0] for s in steps]
    fused_pass(fused, steps, mbs, tok.pad_token_id)
    for step, mb in zip(steps, mbs):
        fused_pass(alone, [step], [mb], tok.pad_token_id)
        for module, (a, b) in fused.slots[step.slot].layers.items():
            a_alone, b_alone = alone.slots[step.slot].layers[module]
            assert float(b.grad.abs().max()) > 0  # B = 0 at the start: A's gradient is 0, B's is not
            torch.testing.assert_close(a.grad, a_alone.grad, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(b.grad, b_alone.grad, rtol=1e-5, atol=1e-9)


def test_a_non_finite_gradient_skips_that_tenants_step_only(base) -> None:
    model, tok = base
    fused, alone = table_with(model), table_with(model)
    before = fused.slots["b"].adapter_state()
    steps = steps_for(0, len(tok), nan="b")
    assert fused_steps(fused, steps, tok.pad_token_id) == {"a": True, "b": False, "c": True, "d": True}
    assert fused.slots["b"].step == 0 and fused.slots["b"].skipped == 1
    assert all(torch.equal(t, fused.slots["b"].adapter_state()[k]) for k, t in before.items())
    for step in steps:
        if step.slot != "b":
            fused_steps(alone, [step], tok.pad_token_id)
            assert_same_slot(fused.slots[step.slot], alone.slots[step.slot])


def test_a_slot_trains_as_a_peft_lora_adapter_with_adamw(base) -> None:
    from peft import LoraConfig, get_peft_model

    from learner.losses import LossInputs, policy_loss
    from rollout.next_token import next_token_logprobs

    model, tok = base
    settings, loss_cfg = SlotSettings(rank=4, alpha=8, lr=1e-2, seed=5), PPOLossConfig()
    table = SlotTable(copy.deepcopy(model), TARGETS)
    slot = table.attach("t", settings)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, bias="none"))
    with torch.no_grad():  # the same starting A (B is zero in both)
        for name, module in peft.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                module.lora_A["default"].weight.copy_(slot.layers[name.removeprefix("base_model.model.")][0])
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    for k in range(3):
        batch = token_batch(k, 4, 14, len(tok))
        fused_steps(table, [TenantStep("t", batch, loss_cfg, 4)], tok.pad_token_id)
        logp, _ = next_token_logprobs(peft, batch.input_ids, batch.attention_mask, 0)
        inputs = LossInputs(logprobs=logp, old_logprobs=logp.detach(), behaviour_logprobs=batch.behaviour,
                            advantages=batch.advantages, mask=batch.loss_mask, turn_ids=batch.turn_ids)
        policy_loss(inputs, loss_cfg, None)[0].backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        opt.zero_grad()
    state = {n.removeprefix("base_model.model."): p for n, p in peft.named_parameters() if p.requires_grad}
    for module, (a, b) in slot.layers.items():
        torch.testing.assert_close(a, state[f"{module}.lora_A.default.weight"], atol=1e-6, rtol=0)
        torch.testing.assert_close(b, state[f"{module}.lora_B.default.weight"], atol=1e-6, rtol=0)


def test_rows_see_the_base_or_their_slots_merged_weights(base) -> None:
    model, tok = base
    table = table_with(model, {"a": TENANTS["a"]})
    fused_steps(table, steps_for(0, len(tok), {"a": TENANTS["a"]}), tok.pad_token_id)
    slot = table.slots["a"]
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in merged.named_modules():
            if name in slot.layers:
                a, b = slot.layers[name]
                module.weight += slot.scale * b @ a
    ids = torch.randint(2, len(tok), (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), table.route(["a", None]):
        mixed = table.model(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(mixed[0], merged(ids[:1]).logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(mixed[1], model(ids[1:]).logits[0], atol=1e-5, rtol=0)


def test_slots_attach_detach_and_round_trip_their_state(base) -> None:
    model, tok = base
    table = table_with(model, {"a": TENANTS["a"]})
    with pytest.raises(ValueError, match="adapter slot 'a' is taken"):
        table.attach("a", SlotSettings())
    fused_steps(table, steps_for(0, len(tok), {"a": TENANTS["a"]}), tok.pad_token_id)
    saved = table.slots["a"].state_dict()
    table.detach("a")
    with pytest.raises(KeyError, match=r"adapter slots \['a'\] that are not attached"), table.route(["a"]):
        pass
    fresh = table.attach("a", TENANTS["a"][0])
    assert fresh.step == 0 and all(float(t.abs().max()) == 0 for k, t in fresh.adapter_state().items() if "lora_B" in k)
    fresh.load_state_dict(saved)
    assert fresh.step == 1 and all(torch.equal(t, saved["adapter"][k]) for k, t in fresh.adapter_state().items())


# -- the pool learner host: tenants against learners of their own ---------------------------
def _groups(seed: int, n: int = 2, size: int = 2) -> list:
    """``n`` groups of ``size`` one- or two-turn rollouts of random tokens and outcomes."""
    from rollout.trajectory import Group, Trajectory, Turn

    gen = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(5, 200, (k,), generator=gen).tolist()  # noqa: E731
    groups = []
    for g in range(n):
        trajs = []
        for r in range(size):
            turns = [Turn(action_ids=rand(4 + t), action_logprobs=[-1.5] * (4 + t), policy_version=0,
                          observation_ids=rand(3) if t == 0 else []) for t in range(1 + (r + g) % 2)]
            trajs.append(Trajectory(trajectory_id=f"{seed}-{g}-{r}", task_id=f"t{seed}-{g}", group_id=f"{seed}-g{g}",
                                    prompt_ids=[5, 6, 7, 8 + g], turns=turns, outcome=float(torch.rand(1, generator=gen))))
        groups.append(Group(group_id=f"{seed}-g{g}", task_id=f"t{seed}-{g}", trajectories=trajs))
    return groups


POOL_TENANTS = {  # name: (learner settings, rollout temperature, data seed)
    "alpha": ({"lr": 2e-2, "lora": {"rank": 4, "alpha": 16.0}}, 1.0, 10),
    "beta": ({"lr": 5e-3, "lora": {"rank": 2, "alpha": 4.0}, "loss": {"type": "ppo", "agg": "token-mean"},
              "estimator": {"type": "grpo", "scale_by_std": False}}, 1.0, 20),
    "gamma": ({"lr": 1e-2, "lora": {"rank": 8, "alpha": 8.0}, "micro_batch_size": 1}, 0.7, 30),
}


def test_pool_tenants_train_as_learners_of_their_own(tiny_policy, tmp_path) -> None:
    """Three tenants with their own data and settings on one pool learner, two fused rounds:
    each adapter equals what a LoRA run's own DeepSpeed learner (``learner.worker``) trains
    from the same start on the same batches; each publishes to its own ports."""
    from learner.config import LearnerConfig
    from learner.lora import adapter_state
    from learner.pool import PoolLearner
    from learner.ports import LocalLearnerPorts
    from learner.worker import LearnerWorker
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore
    from tests.dist_env import own_process_group

    policy = tiny_policy[0]
    pool = PoolLearner(policy, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                       coalesce_s=0.0)
    own, ports = {}, {}
    with own_process_group():
        for name, (extra, temp, seed) in POOL_TENANTS.items():
            cfg = LearnerConfig(batch_groups=2, zero_stage=0, **extra)
            own[name] = LearnerWorker(cfg, policy, str(tmp_path / name), LocalLearnerPorts(
                InProcessReplayStore(ReplayConfig(), 2)), group_size=2, temperature=temp)
            start = adapter_state({k: v.detach() for k, v in own[name].ds_engine.module.state_dict().items()})
            ports[name] = LocalLearnerPorts(InProcessReplayStore(ReplayConfig(), 2))
            assert pool.attach(name, cfg, ports[name], temperature=temp, initial=start) == 0
            assert ports[name].published[0] == 0
        for k in range(2):
            for name, (_, _, seed) in POOL_TENANTS.items():
                for group in _groups(seed + k):
                    ports[name].store.put(group)
                own[name]._update([t for g in _groups(seed + k) for t in g.trajectories])
            metrics = pool.train_round(wait_s=5.0)
            assert sorted(metrics) == sorted(POOL_TENANTS) and all(m["pool/tenants_in_step"] == 3 for m in metrics.values())
    for name, worker in own.items():
        theirs = adapter_state({k: v.detach() for k, v in worker.ds_engine.module.state_dict().items()})
        mine = pool.slot(name).adapter_state()
        assert sorted(mine) == sorted(theirs)
        assert all(float(mine[k].abs().max()) > 1e-4 for k in mine if k.endswith("lora_B.weight"))  # it trained
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], atol=tolerance(pool.slot(name)), rtol=0)
        version, published = ports[name].published
        assert version == 2 and all(torch.equal(published[k], mine[k]) for k in mine)
        assert pool.tenants[name].step == 2 and ports[name].store.stats().claimed == 0


@pytest.mark.parametrize("change, message", [
    ({"lora": None}, "learner.lora: a run on a pool learner trains a LoRA adapter"),
    ({"lora": {"target_modules": ["q_proj"]}}, r"learner.lora.target_modules \['q_proj'\] differ from the pool's"),
    ({"loss": {"type": "trajectory_balance"}}, "the pool learner trains the ppo loss"),
    ({"ppo_epochs": 2}, "the pool learner takes on-policy steps"),
])
def test_what_a_pool_learner_cannot_train_is_refused_naming_the_field(change: dict, message: str) -> None:
    from learner.config import LearnerConfig
    from learner.pool import check_tenant

    cfg = LearnerConfig(**({"lora": {"rank": 4}} | change))
    with pytest.raises(ValueError, match=message):
        check_tenant(cfg, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_a_flooding_tenant_never_keeps_another_out_and_a_freed_slot_is_reusable(tiny_policy) -> None:
    from learner.config import LearnerConfig
    from learner.pool import PoolLearner
    from learner.ports import LocalLearnerPorts
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    pool = PoolLearner(tiny_policy[0], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                       coalesce_s=0.1)
    cfg = LearnerConfig(batch_groups=1, lr=1e-2, lora={"rank": 2})
    ports = {n: LocalLearnerPorts(InProcessReplayStore(ReplayConfig(eta=100), 1)) for n in ("flood", "slow")}
    for name, p in ports.items():
        pool.attach(name, cfg, p, temperature=1.0)
    for group in _groups(1, n=6):
        ports["flood"].store.put(group)
    assert sorted(pool.train_round(wait_s=1.0)) == ["flood"]  # the slow one has nothing: not waited for past coalesce_s
    ports["slow"].store.put(_groups(2, n=1)[0])
    assert sorted(pool.train_round(wait_s=1.0)) == ["flood", "slow"]  # ready: trained in the very next round
    assert (pool.tenants["flood"].step, pool.tenants["slow"].step) == (2, 1)
    pool.detach("slow")  # a cancelled run's slot: free at once, and its name can attach again
    assert "slow" not in pool.table.slots and sorted(pool.train_round(wait_s=1.0)) == ["flood"]
    assert pool.attach("slow", cfg, ports["slow"], temperature=1.0) == 0 and pool.slot("slow").step == 0


def test_a_restarted_pool_learner_resumes_each_tenant_and_trains_nothing_twice(tiny_policy, tmp_path) -> None:
    """Checkpoint every 2 steps; the learner dies after step 3 (trained, acknowledged, not
    committed). A new one resumes the tenant from step 2 (adapter and optimizer as saved),
    replay gives the third batch again, and the trained-groups log holds every group once."""
    import json

    from learner.config import LearnerConfig
    from learner.pool import PoolLearner
    from learner.ports import LocalLearnerPorts
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LearnerConfig(batch_groups=1, lr=1e-2, lora={"rank": 2}, checkpoint_every=2)
    ports = LocalLearnerPorts(InProcessReplayStore(ReplayConfig(eta=100), 1))
    first = PoolLearner(tiny_policy[0], targets, coalesce_s=0.0)
    first.attach("run", cfg, ports, temperature=1.0, run_dir=tmp_path)
    for group in _groups(5, n=3):
        ports.store.put(group)
    for _ in range(3):
        assert sorted(first.train_round(wait_s=1.0)) == ["run"]
    saved = torch.load(tmp_path / "pool_checkpoint" / "step_000002.pt", weights_only=False)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 2 and saved["step"] == 2
    _merges_to_the_slots_weights(tmp_path / "checkpoints" / "step_000002", tiny_policy[0], saved["adapter"],
                                 cfg.lora.alpha / cfg.lora.rank)
    ports.store.recover(2)  # as the driver does for a restarted learner: claims after the checkpoint come back
    again = PoolLearner(tiny_policy[0], targets, coalesce_s=0.0)
    assert again.attach("run", cfg, ports, temperature=1.0, run_dir=tmp_path, resume=True) == 2
    slot = again.slot("run")
    assert slot.step == 2 and all(torch.equal(t, saved["adapter"][k]) for k, t in slot.adapter_state().items())
    assert again.train_round(wait_s=1.0)["run"]["step"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "trained_groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sorted(g for r in rows for g in r["group_ids"]) == sorted(g.group_id for g in _groups(5, n=3))


def _merges_to_the_slots_weights(folder, base: str, adapter: dict, scale: float) -> None:
    """``folder`` is a LoRA checkpoint of ``base`` whose merge (peft's, as ``turnrl models
    merge`` and ``turnrl eval`` do it) holds W + scale * B @ A for every adapted layer."""
    from transformers import AutoModelForCausalLM

    from learner.lora import base_of, is_lora_checkpoint, merged_folder
    from rollout.engines.adapters import A_SUFFIX, B_SUFFIX

    assert is_lora_checkpoint(folder) and Path(base_of(folder)) == Path(base).resolve()
    merged = AutoModelForCausalLM.from_pretrained(merged_folder(folder), dtype=torch.float32).state_dict()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    layers = {k.removesuffix(A_SUFFIX) for k in adapter if k.endswith(A_SUFFIX)}
    assert layers and all(layer + ".weight" in merged for layer in layers)
    for layer in layers:
        want = plain[layer + ".weight"] + scale * adapter[layer + B_SUFFIX] @ adapter[layer + A_SUFFIX]
        assert torch.allclose(merged[layer + ".weight"], want, atol=1e-6)
        assert not torch.equal(merged[layer + ".weight"], plain[layer + ".weight"])  # trained: B moved from 0


class _DeadPorts:
    """A tenant's ports after its run died: its replay is gone."""

    def claim(self, *args, **kwargs):
        raise ConnectionError("replay host is gone")

    def publish(self, *args, **kwargs) -> None:
        pass


def test_a_tenant_whose_run_died_is_dropped_and_a_tenant_trains_only_the_steps_it_asks_for(tiny_policy) -> None:
    from learner.config import LearnerConfig
    from learner.pool import PoolLearner
    from learner.ports import LocalLearnerPorts
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    pool = PoolLearner(tiny_policy[0], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                       coalesce_s=0.0)
    cfg = LearnerConfig(batch_groups=1, lr=1e-2, lora={"rank": 2})
    ports = LocalLearnerPorts(InProcessReplayStore(ReplayConfig(eta=100), 1))
    pool.attach("asks", cfg, ports, temperature=1.0, on_request=True)
    pool.attach("dead", cfg, _DeadPorts(), temperature=1.0)
    for group in _groups(3, n=3):
        ports.store.put(group)
    assert pool.train_round(wait_s=0.2) == {}  # "asks" asked for nothing; "dead" failed its claim
    assert sorted(pool.tenants) == ["asks"] and "dead" not in pool.table.slots
    assert pool.failed == {"dead": "ConnectionError: replay host is gone"}
    pool.request("asks", 2)
    assert [sorted(pool.train_round(wait_s=1.0)) for _ in range(3)] == [["asks"], ["asks"], []]
    assert pool.tenants["asks"].step == 2 and ports.store.stats().ready == 1  # the third group waits in replay
    pool.detach("asks")  # its learner replaced inside a running job: versions go on above what engines serve
    assert pool.attach("asks", cfg, ports, temperature=1.0, version_floor=7) == 8 and ports.published[0] == 8
