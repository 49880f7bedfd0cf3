"""Per-tenant limits on every number in a RunConfig that buys CPU, memory or time.

``BUDGETS`` maps each such field ("<pydantic class>.<field>", checked wherever the class is
nested) to the ``LimitsConfig`` entry that caps it; ``FREE`` lists every other number with why
it buys nothing a limit must cap (a rate, a seed, a weight, a bounded choice, or a resource
``demand()`` counts). ``tests/test_services_limits.py`` walks the RunConfig schema and fails on a
number in neither, so a new knob cannot slip past unlimited. ``number_errors`` returns one 422
entry per field over its limit, naming the field and the limit; ``memory_gib`` and
``tiny_params`` sum what several fields buy together.
"""

from __future__ import annotations

from typing import Any, Iterator

from pydantic import BaseModel

from services.config import LimitsConfig

# field -> (limit, unit the field is in, relative to the limit's: ms fields under a seconds limit
# are divided by 1000)
BUDGETS: dict[str, tuple[str, float]] = {
    "TrainConfig.steps": ("max_steps", 1), "SFTConfig.steps": ("max_sft_steps", 1),
    # tokens one sequence, request or pass may hold
    **{f: ("max_tokens", 1) for f in (
        "RolloutConfig.max_new_tokens", "RolloutConfig.max_context_tokens", "LiveConfig.default_max_tokens",
        "LiveConfig.max_context_tokens", "VLLMEngineConfig.max_model_len", "HFEngineConfig.score_batch_tokens",
        "IGConfig.token_budget", "TinyModelConfig.max_positions", "PRMConfig.token_budget",
        "JudgeConfig.max_new_tokens", "JudgeConfig.max_context_chars")},
    # sequences, groups or requests held or processed together
    **{f: ("max_batch", 1) for f in (
        "RolloutConfig.group_size", "RolloutConfig.groups_in_flight", "LearnerConfig.batch_groups",
        "LearnerConfig.micro_batch_size", "LearnerConfig.ppo_epochs", "LearnerConfig.mini_batches",
        "SFTConfig.batch_size", "HFEngineConfig.max_batch", "VLLMEngineConfig.max_num_seqs",
        "HFEngineConfig.max_concurrency", "VLLMEngineConfig.max_concurrency", "EnvActorsConfig.max_concurrency",
        "ServiceConfig.max_batch_trajectories", "ServiceConfig.queue_groups", "ReplayConfig.capacity_groups",
        "ReplayConfig.max_concurrent_groups", "ReplayConfig.live_capacity_groups", "EvalConfig.samples_per_task",
        "IGConfig.keep_versions", "HGPOConfig.history", "RolloutConfig.history_turns", "JudgeConfig.batch_size",
        "JudgeConfig.queue_size", "PRMTrainConfig.batch_size", "PRMTrainConfig.epochs", "VLLMEngineConfig.max_loras",
        "LiveConfig.max_concurrent", "LiveConfig.max_concurrent_per_token")},
    # tasks, demos, sessions, iterations: work or memory in proportion
    **{f: ("max_items", 1) for f in (
        "SFTConfig.num_demos", "SearchQAConfig.num_train_tasks", "SearchQAConfig.num_heldout_tasks",
        "SearchQAConfig.max_train_pairs", "SearchDataConfig.max_train_tasks", "SearchDataConfig.max_heldout_tasks",
        "ToolUseConfig.num_train_tasks", "ToolUseConfig.num_heldout_tasks", "HouseholdConfig.num_train_tasks",
        "HouseholdConfig.num_heldout_tasks", "EvalConfig.num_tasks", "EvalConfig.bootstrap_resamples",
        "BfclConfig.max_tasks_per_category", "MatchConfig.sinkhorn_iters", "TrajectoryBalanceConfig.max_tasks", "LiveConfig.max_sessions",
        "LiveConfig.max_kept_responses",
        "PRMTrainConfig.num_tasks", "PRMTrainConfig.heldout_tasks", "ReasoningGymConfig.num_train_tasks",
        "ReasoningGymConfig.num_heldout_tasks", "OpenEnvConfig.num_train_tasks", "OpenEnvConfig.num_heldout_tasks",
        "VerifiersConfig.num_train_tasks", "VerifiersConfig.num_heldout_tasks")},
    **{f: ("max_threads", 1) for f in (
        "RolloutConfig.torch_threads", "HFEngineConfig.torch_threads", "VLLMEngineConfig.torch_threads",
        "LearnerConfig.torch_threads", "ServiceConfig.torch_threads")},
    # how long something may hold its resources while waiting
    **{f: ("max_wait_s", 1) for f in (
        "RolloutConfig.restart_timeout_s", "WeightSyncConfig.timeout_s",
        "ReplayConfig.put_timeout_s", "ReplayConfig.connect_timeout_s", "ReplayConfig.socket_timeout_s",
        "ReplayConfig.retry_s", "LearnerConfig.claim_timeout_s", "LiveConfig.feedback_timeout_s",
        "LiveConfig.close_after_feedback_s", "LiveConfig.retry_after_s", "JudgeConfig.timeout_s",
        "LiveConfig.stream_stall_timeout_s")},
    **{f: ("max_wait_s", 1000) for f in (
        "HFEngineConfig.batch_wait_ms", "HFEngineConfig.join_wait_ms", "ServiceConfig.batch_wait_ms")},
    **{f: ("max_restarts", 1) for f in (
        "RolloutConfig.max_restarts", "HFEngineConfig.max_restarts", "VLLMEngineConfig.max_restarts",
        "EnvActorsConfig.max_restarts", "LearnerConfig.max_restarts", "ClusterConfig.service_max_restarts")},
    # memory: summed by memory_gib (checked against max_memory_gib there)
    **{f: ("max_memory_gib", 1) for f in (
        "VLLMEngineConfig.cpu_kv_cache_gib", "HFEngineConfig.prefix_cache_mib", "ReplayConfig.capacity_bytes",
        "WeightSyncConfig.bucket_mib")},
    # the builtin policy's size: summed by tiny_params (checked against max_tiny_params there)
    **{f"TinyModelConfig.{f}": ("max_tiny_params", 1) for f in (
        "hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size")},
}
SUMMED = {"max_memory_gib", "max_tiny_params"}

_RATE = "a rate, weight, coefficient or bound of the maths: changes results, not the resources used"
_COUNTED = "resources demand() counts against max_actors, max_cpus and max_gpus"
_BOUNDED = "a small choice the schema bounds (le=...)"
FREE: dict[str, str] = {
    **{f: "a random seed" for f in ("SFTConfig.seed", "SearchQAConfig.seed", "ToolUseConfig.seed",
                                     "HouseholdConfig.seed", "TrainConfig.seed", "PRMTrainConfig.seed",
                                     "BfclConfig.split_seed", "ReasoningGymConfig.seed", "OpenEnvConfig.seed",
                                     "VerifiersConfig.seed")},
    **{f: _RATE for f in (
        "SFTConfig.lr", "SFTConfig.context_loss_weight", "SFTConfig.guess_fraction", "RolloutConfig.temperature",
        "RolloutConfig.top_p", "OutcomeConfig.format_penalty", "OutcomeConfig.weight", "IGConfig.weight",
        "MatchConfig.sinkhorn_reg", "MatchConfig.unmatched_penalty", "MatchConfig.no_call_reward",
        "MatchConfig.weight", "LearnerConfig.lr", "LearnerConfig.weight_decay", "LearnerConfig.grad_clip",
        "GRPOConfig.eps", "IGPOConfig.gamma", "IGPOConfig.ig_weight", "IGPOConfig.var_floor", "IGPOConfig.eps",
        "A2TGPOConfig.gamma", "A2TGPOConfig.ig_weight", "A2TGPOConfig.clip_low", "A2TGPOConfig.clip_high",
        "A2TGPOConfig.clip_beta", "A2TGPOConfig.eps", "MatchTIRConfig.gamma", "MatchTIRConfig.eps",
        "PRMEstimatorConfig.gamma", "PRMEstimatorConfig.eps", "GiGPOConfig.step_weight", "GiGPOConfig.gamma",
        "GiGPOConfig.invalid_penalty", "GiGPOConfig.eps", "HGPOConfig.alpha", "HGPOConfig.gamma",
        "HGPOConfig.invalid_penalty", "HGPOConfig.eps", "LiveBaselineConfig.decay", "LiveBaselineConfig.gamma",
        "LiveBaselineConfig.var_floor", "PPOLossConfig.clip_low", "PPOLossConfig.clip_high", "PPOLossConfig.tis_cap",
        "PPOLossConfig.kl_coef", "PPOLossConfig.entropy_coef", "TrajectoryBalanceConfig.log_z_init",
        "TrajectoryBalanceConfig.log_z_lr", "TrajectoryBalanceConfig.log_reward_floor", "EvalConfig.temperature",
        "HouseholdConfig.success_reward", "HouseholdConfig.invalid_penalty", "TrainConfig.live_fraction",
        "VLLMEngineConfig.gpu_memory_utilization", "RewardsConfig.weights", "ReplayConfig.eta",
        "HFEngineConfig.stale_kv_versions", "VLLMEngineConfig.stale_kv_versions",
        "SearchQAConfig.hop_weights", "JudgeConfig.clip_bound", "JudgeConfig.clip_shift", "JudgeConfig.score_max",
        "JudgeConfig.score_min", "JudgeConfig.weight", "PRMConfig.clip_bound", "PRMConfig.clip_shift",
        "PRMConfig.weight", "PRMTrainConfig.bad_step_rate", "PRMTrainConfig.lr", "BfclConfig.heldout_fraction",
        "LoRAConfig.alpha", "LoRAConfig.dropout", "ReasoningGymTask.weight", "OpenEnvConfig.success_at",
        "VerifiersConfig.heldout_fraction", "VerifiersConfig.success_at")},
    **{f: _BOUNDED for f in (
        "SearchQAConfig.num_entities", "SearchQAConfig.hops", "SearchQAConfig.top_k", "SearchQAConfig.max_turns",
        "SearchQAConfig.train_worlds", "SearchQAConfig.extra_turns", "ToolUseConfig.min_calls", "ToolUseConfig.max_calls",
        "ToolUseConfig.max_turns", "ToolUseConfig.tool_timeout_s", "ToolUseConfig.tool_memory_mb",
        "HouseholdConfig.max_turns", "HouseholdConfig.other_rooms", "LiveConfig.port", "JudgeConfig.retries",
        "BfclConfig.max_turns", "BfclConfig.max_steps_per_turn", "BfclConfig.tool_timeout_s",
        "BfclConfig.check_timeout_s", "BfclConfig.tool_memory_mb", "LoRAConfig.rank",
        "VLLMEngineConfig.max_lora_rank", "ReasoningGymConfig.max_turns", "ReasoningGymConfig.tool_timeout_s",
        "ReasoningGymConfig.tool_memory_mb", "McpTasksConfig.max_turns", "McpServerConfig.call_timeout_s",
        "OpenEnvConfig.max_turns", "OpenEnvConfig.step_timeout_s", "OpenEnvServerConfig.start_timeout_s",
        "VerifiersConfig.max_turns", "VerifiersConfig.step_timeout_s")},
    **{f: _COUNTED for f in (
        "RolloutConfig.num_workers", "RolloutConfig.num_cpus", "HFEngineConfig.count", "HFEngineConfig.num_cpus",
        "HFEngineConfig.num_gpus", "VLLMEngineConfig.count", "VLLMEngineConfig.num_cpus", "VLLMEngineConfig.num_gpus",
        "VLLMEngineConfig.tensor_parallel_size", "EnvActorsConfig.count", "EnvActorsConfig.num_cpus",
        "ServiceConfig.num_scorers", "ServiceConfig.scorer_num_cpus", "ServiceConfig.judge_num_cpus",
        "LearnerConfig.num_cpus", "LearnerConfig.num_gpus", "LearnerConfig.world_size", "ClusterConfig.num_cpus",
        "ClusterConfig.reward_num_cpus", "ClusterConfig.replay_num_cpus", "LiveConfig.num_cpus",
        "RolloutConfig.resources", "HFEngineConfig.resources", "VLLMEngineConfig.resources",
        "EnvActorsConfig.resources", "LearnerConfig.resources", "ClusterConfig.service_resources",
        "JudgeConfig.num_workers",
        "HFEngineConfig.cpu_affinity", "VLLMEngineConfig.cpu_affinity", "RolloutConfig.cpu_affinity",
        "LearnerConfig.cpu_affinity", "ClusterConfig.cpu_affinity", "ClusterConfig.services_cpu_affinity")},
    "LearnerConfig.checkpoint_every": "how often a checkpoint is written; the run keeps a bounded number",
    "EvalConfig.every_steps": "how often the held-out evaluation runs; its size is max_items (eval.num_tasks)",
}


def _numbers(model: BaseModel, loc: tuple[str, ...] = ()) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """("<class>.<field>", key path, value) of every field of ``model`` and its sections."""
    for name, info in type(model).model_fields.items():
        value, here = getattr(model, name), (*loc, info.alias or name)
        yield f"{type(model).__name__}.{name}", here, value
        children = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
        for i, child in enumerate(children):
            if isinstance(child, BaseModel):
                yield from _numbers(child, here if child is value else (*here, str(i)))


def show(value: float) -> str:
    """A number as people write it: whole numbers in full (50000000, not 5e+07)."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(round(value, 3)) if 0.001 <= abs(value) < 1e15 else f"{value:g}"


def number_errors(cfg: BaseModel, limits: LimitsConfig) -> list[tuple[str, str]]:
    """(key path, message) for every budgeted field over its own limit."""
    errors = []
    for key, loc, value in _numbers(cfg):
        limit, unit = BUDGETS.get(key, (None, 1))
        if limit is None or limit in SUMMED or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        allowed, seconds = getattr(limits, limit), value / unit
        over = seconds < allowed if limit.startswith("min_") else seconds > allowed
        if over:
            errors.append((".".join(loc), f"{show(value)} is {'below' if limit.startswith('min_') else 'over'} "
                                          f"limits.{limit}={show(allowed)}"))
    return errors


def summed_errors(cfg: Any, limits: LimitsConfig) -> list[tuple[str, str]]:
    """("<root>", message) for each limit on what several fields buy together."""
    errors = []
    for need, limit, how in ((memory_gib(cfg), "max_memory_gib", "GiB of memory (rollout.engine.count x the "
                              "engine's cpu_kv_cache_gib or prefix_cache_mib + replay.capacity_bytes + "
                              "rollout.weights.bucket_mib)"),
                             (tiny_params(cfg), "max_tiny_params", "parameters in policy.tiny")):
        allowed = getattr(limits, limit)
        if need > allowed + 1e-9:
            errors.append(("<root>", f"the run asks for {show(need)} {how}; limits.{limit}={show(allowed)}"))
    return errors


def memory_gib(cfg: Any) -> float:
    """Memory the run's settings reserve: the engines' KV caches (vLLM ``cpu_kv_cache_gib``, hf
    ``prefix_cache_mib``) per engine, replay's ``capacity_bytes`` and a broadcast bucket."""
    eng = cfg.rollout.engine
    cache = eng.cpu_kv_cache_gib if eng.type == "vllm" else eng.prefix_cache_mib / 1024
    return eng.count * cache + cfg.replay.capacity_bytes / 2**30 + cfg.rollout.weights.bucket_mib / 1024


def tiny_params(cfg: Any) -> int:
    """Parameters of the builtin policy (``policy.tiny``; 0 for any other policy): embeddings
    and head, plus per layer attention (4 h^2) and the gated MLP (3 h i)."""
    if cfg.policy.path != "builtin:tiny":
        return 0
    t = cfg.policy.tiny
    return 2 * t.vocab_size * t.hidden_size + t.num_layers * (4 * t.hidden_size ** 2 + 3 * t.hidden_size * t.intermediate_size)
