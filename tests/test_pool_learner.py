"""The pool learner's core (learner.adapter_slots, learner.pool_step) on a tiny real Llama: a
slot trains as a peft LoRA adapter with AdamW does; several tenants' micro-batches fused through
one base pass leave every tenant's adapter and optimizer state equal to training it alone on the
same batches (fp32, to 1e-5); a non-finite gradient skips its own tenant's step only; rows
routed to no slot see the base model, and a slot's rows see what its merged weights compute."""

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


ATOL = 1e-5
"""fp32: batch composition changes the sums' rounding (~1e-7 relative), which Adam's normalised
steps carry into parameters moved ~1e-2 a step: measured differences ~1e-6 after 3 steps."""


def assert_same_slot(x, y, atol: float = ATOL) -> None:
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
