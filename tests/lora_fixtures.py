"""LoRA adapters for tests, made by the learner's own code (``learner.lora.wrap``) with random B
(peft starts B at 0, which is the base model)."""

from __future__ import annotations

import torch

from learner.config import LoRAConfig


def random_adapter(policy: str, lora: LoRAConfig, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the adapter's tensors as engines load them, the merged full state) of a fresh peft
    adapter of ``policy`` with B drawn from N(0, 0.3) under ``seed``."""
    from transformers import AutoModelForCausalLM

    from learner.lora import adapter_state, merged_state, wrap

    torch.manual_seed(seed)
    peft = wrap(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32), lora)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    state = {k: v.detach().clone() for k, v in peft.state_dict().items()}
    return adapter_state(state), merged_state(state, lora)
