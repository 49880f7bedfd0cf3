"""LoRA policies (``learner.lora``): wrapping the policy with peft, the merged weights the
learner publishes, LoRA checkpoints and their merge into a plain Hugging Face folder.

A LoRA run trains only the adapters; the base weights stay frozen. Engines, scorers and the
live endpoint keep loading whole weights under the base model's names: what the learner
publishes is ``W + (alpha / rank) * B @ A`` for every adapted layer (``merged_state``), the
weights ``merge_and_unload`` would give, computed from the state dict without touching the
model being trained. A checkpoint holds peft's adapter files, the tokenizer and
``turnrl_lora.json``, which names the base; ``merged_folder`` turns one into a plain folder
(cached beside it) for ``turnrl eval``, ``policy.path`` and ``turnrl models merge``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from learner.config import LoRAConfig
from rollout.engines.adapters import A_SUFFIX, B_SUFFIX
from storage.files import atomic_folder

MARKER = "turnrl_lora.json"
"""In a LoRA checkpoint: the base the adapter was trained on, and its shape."""
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's name for the one adapter a run trains


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of every ``nn.Linear`` in ``model``."""
    return [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target names (or is a dotted suffix of) a linear module of ``model``; peft
    itself only fails when none does, silently adapting fewer layers than asked."""
    names = linear_module_names(model)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"learner.lora.target_modules: {missing} match no linear module of the policy; "
                         f"its linear modules are named {short} (a dotted suffix such as "
                         f"'self_attn.q_proj' narrows one down)")


def check_policy(path: str | Path, cfg: LoRAConfig) -> None:
    """``check_targets`` against the policy folder's architecture, built on the meta device
    (no weights read, milliseconds): the driver's check before any actor starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    check_targets(model, cfg.target_modules)


def wrap(model: torch.nn.Module, cfg: LoRAConfig) -> Any:
    """``model`` with fresh adapters on ``cfg.target_modules`` (B = 0, so it computes
    exactly what the base does); only the adapters require grad."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, cfg.target_modules)
    conf = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, conf)


def merged_state(state: Mapping[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in, from a ``PeftModel``'s
    state dict (names as the plain model has them; the adapters' dropout is a training-time
    noise and has no part in it)."""
    scale = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        layer = key.removesuffix(".base_layer.weight")
        if layer != key and f"{layer}.lora_A.{ADAPTER}.weight" in state:
            a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            value = value + scale * (b.to(value.dtype) @ a.to(value.dtype))
        out[name] = value
    return out


def is_adapter_tensor(name: str) -> bool:
    """A ``PeftModel`` state-dict name of the run's adapter (``...lora_A.default.weight``)."""
    return name.endswith((f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"))


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors alone from a ``PeftModel``'s state dict, under the base model's
    module names (``<module>.lora_A.weight``, ``<module>.lora_B.weight``): what an engine
    serving adapters (``rollout.engines.adapters``) loads, scaled by ``alpha / rank``, to
    compute what ``merged_state`` computes."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for part, suffix in ((".lora_A.", A_SUFFIX), (".lora_B.", B_SUFFIX)):
            marker = f"{part}{ADAPTER}.weight"
            if key.endswith(marker):
                out[key.removeprefix(PEFT_PREFIX).removesuffix(marker) + suffix] = value
    return out


def save_adapter(model: Any, state: Mapping[str, torch.Tensor], path: Path, base: str, cfg: LoRAConfig) -> None:
    """peft's ``adapter_model.safetensors`` + ``adapter_config.json`` of ``state`` (the
    full state dict, gathered) into ``path``, and ``turnrl_lora.json`` naming ``base``."""
    model.save_pretrained(str(path), state_dict=dict(state), save_embedding_layers=False)
    _write_marker(path, base, cfg)


def write_adapter(adapter: Mapping[str, torch.Tensor], path: Path, base: str, cfg: LoRAConfig) -> None:
    """The files ``save_adapter`` writes, from an adapter as engines load it
    (``adapter_state``'s names; the pool learner's slots hold it so): peft's weights and config,
    and the marker naming ``base``. ``merged_folder`` and ``turnrl models merge`` read it."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + name: t.detach().contiguous() for name, t in adapter.items()},
              str(path / "adapter_model.safetensors"))
    LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
               bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base).save_pretrained(str(path))
    _write_marker(path, base, cfg)


def _write_marker(path: Path, base: str, cfg: LoRAConfig) -> None:
    marker = {"base": base, "lora": cfg.model_dump(), "note": "a LoRA adapter: `turnrl models merge` "
              "writes base + adapter as a plain Hugging Face folder"}
    (path / MARKER).write_text(json.dumps(marker, indent=2))


def is_lora_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def base_of(checkpoint: str | Path) -> str:
    """The base model a LoRA checkpoint's adapter belongs to (a local folder, made local
    from storage when it is a stored one)."""
    from storage import node_copy

    base = json.loads((Path(checkpoint) / MARKER).read_text())["base"]
    local = node_copy(base)
    if not (Path(local) / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: its base model {base!r} ({MARKER}) is not a Hugging Face "
                                "folder here; the adapter needs the base it was trained on")
    return local


def merge_into(checkpoint: str | Path, out: str | Path) -> Path:
    """Base + adapter of LoRA ``checkpoint`` as a plain Hugging Face folder ``out``
    (weights, config, tokenizer): peft's ``merge_and_unload``. Written to a temporary folder
    renamed into place, so a reader never sees half of one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out).resolve()
    base = AutoModelForCausalLM.from_pretrained(base_of(checkpoint), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()

    def build(tmp: Path) -> None:
        merged.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(checkpoint)).save_pretrained(tmp)

    return atomic_folder(out, build)


def merged_folder(checkpoint: str | Path) -> Path:
    """A loadable folder for ``checkpoint``: itself when it is a plain one, else its merge,
    built once into ``<checkpoint>/merged`` (inside the run directory) and reused."""
    checkpoint = Path(checkpoint)
    if not is_lora_checkpoint(checkpoint):
        return checkpoint
    cached = checkpoint / "merged"
    if (cached / "config.json").is_file():
        return cached
    return merge_into(checkpoint, cached)
