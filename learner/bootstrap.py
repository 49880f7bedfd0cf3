"""Resolve the run's policy to a local Hugging Face folder, building and caching it if needed.

``builtin:tiny`` creates a tokenizer and a random-init model from the environment's text and
warm-starts it by SFT on the environment's demonstrations. The result is cached under a hash
of everything that shapes it, so a second run (or the test suite) reuses it.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from envs.base import TaskSource
from envs.formats import DEFAULT_FORMAT
from learner.config import PolicyConfig
from storage.files import atomic_folder
from storage.places import local_dir

BOOTSTRAP_VERSION = 4  # bump when the tokenizer, template or SFT recipe changes


def env_key(env_cfg: Any) -> str:
    """The environment config as a warm start's cache key reads it. An empty ``mcp`` list is left
    out, as it was before environments took MCP servers, so every policy cached before keeps its
    key; servers listed change the prompts' tools, so then they count."""
    return env_cfg.model_dump_json(exclude=None if getattr(env_cfg, "mcp", None) else {"mcp"})


def cache_key(cfg: PolicyConfig, env_fingerprint: str, history_turns: int | None = None,
              chat_format: str = DEFAULT_FORMAT) -> str:
    shape = {"v": BOOTSTRAP_VERSION, "tiny": cfg.tiny.model_dump(), "sft": cfg.sft.model_dump(),
             "env": env_fingerprint}
    if history_turns is not None:  # absent when None, so whole-episode policies keep their keys
        shape["history_turns"] = history_turns
    if chat_format != DEFAULT_FORMAT:  # likewise: Hermes policies keep theirs
        shape["chat_format"] = chat_format
    blob = json.dumps(shape, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _corpus(source: TaskSource) -> list[str]:
    texts = list(source.corpus_text())
    for task in source.tasks("train")[:200]:
        texts += [m["content"] for m in task.messages]
        texts += [m["content"] for m in source.demonstration(task)]
        texts.append(json.dumps(task.tools))
    return texts


def build_tiny_policy(cfg: PolicyConfig, source: TaskSource, out_dir: Path, show_progress: bool,
                      demo_source: TaskSource | None = None, history_turns: int | None = None,
                      chat_format: str = DEFAULT_FORMAT) -> dict:
    """Tokenizer from the text of ``source`` (and ``demo_source``), random init, SFT on
    demonstrations of ``demo_source`` (default ``source``) windowed by ``history_turns``."""
    from learner.sft import run_sft
    from learner.tiny_policy import create_model, train_tokenizer

    t0 = time.perf_counter()
    if demo_source is None:
        demo_source = source
    texts = _corpus(source) + (_corpus(demo_source) if demo_source is not source else [])
    tokenizer = train_tokenizer(texts, cfg.tiny.vocab_size, out_dir, cfg.tiny.split_digits)
    model = create_model(cfg.tiny, tokenizer, cfg.sft.seed, out_dir)
    stats = {"params": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}
    if cfg.sft.enabled and cfg.sft.steps > 0:
        import torch

        torch.manual_seed(cfg.sft.seed)
        stats |= run_sft(model, tokenizer, demo_source, cfg.sft, show_progress, history_turns, chat_format)
        model.save_pretrained(out_dir)
    stats["build_s"] = time.perf_counter() - t0
    (out_dir / "turnrl_bootstrap.json").write_text(json.dumps(stats, indent=2))
    return stats


def demo_env_config(cfg: PolicyConfig, env_cfg: BaseModel) -> BaseModel | None:
    """The environment config demonstrations come from when ``policy.sft.env`` replaces keys
    of the run's, validated (errors name the key); None when it replaces none."""
    if not cfg.sft.env:
        return None
    try:
        return type(env_cfg).model_validate({**env_cfg.model_dump(), **cfg.sft.env})
    except ValidationError as exc:
        problems = "; ".join(
            ".".join(["policy.sft.env", *map(str, e["loc"])]) + f": {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{problems} (keys of the {env_cfg.type} environment config)") from exc


def ensure_policy(cfg: PolicyConfig, env_cfg: BaseModel, source: TaskSource | None, show_progress: bool = True,
                  history_turns: int | None = None, chat_format: str = DEFAULT_FORMAT) -> Path:
    """Local folder holding the policy's weights and tokenizer; ``source`` is ``env_cfg``'s
    (None: built from it if a tiny policy must be built). ``history_turns`` is the rollouts'
    window (``rollout.history_turns``) and ``chat_format`` theirs (``rollout.chat_format``):
    SFT trains on the contexts the policy will act from."""
    if not cfg.path.startswith("builtin:"):
        from storage.places import model_ref

        # storage.places' rule: a path only if it exists (never a hub lookup), a URL or hub id as is
        ref = model_ref(cfg.path, "policy.path")
        if not Path(ref).is_absolute():
            return ref
        from learner.lora import merged_folder

        return merged_folder(ref)  # a LoRA checkpoint: base + adapter, merged once beside it
    from learner.pretrained import PACKAGED

    name = cfg.path.removeprefix("builtin:")
    if name != "tiny" and name not in PACKAGED:
        raise ValueError(f"policy.path: unknown builtin {cfg.path!r}; known: "
                         f"{['builtin:tiny', *(f'builtin:{n}' for n in PACKAGED)]}")
    if name != "tiny":
        return _pretrained_policy(name, cfg, env_cfg, show_progress, history_turns, chat_format)
    demo_cfg = demo_env_config(cfg, env_cfg)
    final = local_dir(cfg.cache_dir, "policy.cache_dir") / cache_key(cfg, env_key(env_cfg), history_turns,
                                                                     chat_format)

    def build(tmp: Path) -> None:
        from envs.registry import make_task_source

        demo_source = make_task_source(demo_cfg) if demo_cfg is not None else None
        build_tiny_policy(cfg, source or make_task_source(env_cfg), tmp, show_progress, demo_source, history_turns,
                          chat_format)

    return _cached(final, build)


def ensure_policy_apart(cfg: PolicyConfig, env_cfg: BaseModel, show_progress: bool = True,
                        history_turns: int | None = None, chat_format: str = DEFAULT_FORMAT) -> Path:
    """``ensure_policy`` in a child process (the driver's): building a policy (a conversion, an
    SFT warm start, a LoRA merge) loads torch, the model, its gradients and optimizer state,
    which a process keeps as its own memory after it is done with them. The child gives all of
    it back as it exits, before the run's actors start; the driver holds no torch. Errors are
    raised here as the child raised them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
        return Path(child.submit(ensure_policy, cfg, env_cfg, None, show_progress, history_turns,
                                 chat_format).result())


def _cached(final: Path, build) -> Path:
    """``final`` once ``build(tmp)`` has filled a temporary folder renamed into its place;
    at once if a complete one (with its ``turnrl_bootstrap.json``) is there. A complete one
    another process finished meanwhile (two test workers sharing a cache) is kept: replacing
    it would pull the folder from under the runs already reading it."""
    marker = final / "turnrl_bootstrap.json"
    if marker.exists():
        return final
    return atomic_folder(final, build, done=marker.exists)


def _pretrained_policy(name: str, cfg: PolicyConfig, env_cfg: BaseModel, show_progress: bool,
                       history_turns: int | None, chat_format: str = DEFAULT_FORMAT) -> Path:
    """A packaged pretrained model (``learner/pretrained.py``), converted once into
    ``policy.models_dir``; with SFT on, fine-tuned on the environment's demonstrations and
    cached like the tiny policy (the key names the model instead of the tiny shape)."""
    from learner.pretrained import CONVERT_VERSION, convert

    base = convert(name, cfg.models_dir)
    if not cfg.sft.enabled or cfg.sft.steps == 0:
        return base
    demo_cfg = demo_env_config(cfg, env_cfg) or env_cfg
    shape = {"v": BOOTSTRAP_VERSION, "pretrained": name, "convert": CONVERT_VERSION, "sft": cfg.sft.model_dump(),
             "env": env_key(env_cfg), "history_turns": history_turns}
    if chat_format != DEFAULT_FORMAT:  # absent for Hermes, so existing keys stay
        shape["chat_format"] = chat_format
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from envs.registry import make_task_source
        from learner.sft import run_sft

        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(cfg.sft.seed)
        stats = run_sft(model, tokenizer, make_task_source(demo_cfg), cfg.sft, show_progress, history_turns,
                        chat_format)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stats |= {"params": sum(p.numel() for p in model.parameters()), "base": str(base),
                  "build_s": time.perf_counter() - t0}
        (tmp / "turnrl_bootstrap.json").write_text(json.dumps(stats, indent=2))

    return _cached(local_dir(cfg.cache_dir, "policy.cache_dir") / f"{name}-{key}", build)
