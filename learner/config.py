"""Learner and policy configuration (pydantic only; no torch at import)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.advantages.config import EstimatorConfig, GRPOConfig, LiveBaselineConfig
from learner.losses.config import LossConfig, PPOLossConfig


class TinyModelConfig(BaseModel):
    """A small policy created locally (random init), for CPU runs and tests."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    architecture: Literal["llama", "qwen2"] = "llama"
    """Model family of the created config."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (key/value heads equal)."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width."""
    vocab_size: int = Field(2048, ge=300)
    """Target size of the byte-level BPE vocabulary trained on the environment's text."""
    max_positions: int = Field(2048, ge=64)
    """Longest context the model supports."""
    split_digits: bool = False
    """Tokenize every digit on its own. Numbers then share ten well-trained tokens, so a tiny
    model copies any number from a question or a tool's output digit by digit; with merged
    digit runs ("0015") each number is its own rare token, and copying fails
    (docs/results/learning_bench.md, tool use). Off by default: it lengthens sequences, and text tasks do
    not need it."""


class SFTConfig(BaseModel):
    """Supervised warm start on environment demonstrations, cached by content hash."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Fine-tune on demonstrations before RL (builtin models only need it to ever succeed)."""
    steps: int = Field(300, ge=0)
    """Optimizer steps."""
    batch_size: int = Field(16, ge=1)
    """Demonstrations per step."""
    lr: float = Field(3e-3, gt=0)
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    context_loss_weight: float = Field(1.0, ge=0)
    """Loss weight on prompt and observation tokens relative to action tokens. Predicting the
    environment's text (documents repeat the names searched for) teaches a from-scratch model
    to copy far sooner than action tokens alone; 0 gives plain action-only SFT."""
    num_demos: int = Field(1000, ge=1)
    """Training tasks turned into demonstrations."""
    guess_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of demonstrations (a seeded choice) that answer at once, without calling a
    tool, with a guess (another task's gold answer). The warm start then sometimes answers
    without looking, as instruct models do before agent training; only searching answers
    questions about facts it has never seen, so RL has a behaviour to learn that carries over
    to held-out questions (docs/results/demo.md). 0: every demonstration uses the tools."""
    env: dict[str, Any] = {}
    """Environment config keys replaced for the demonstrations, so the warm start sees other
    questions than RL trains on: e.g. ``{num_heldout_tasks: 300, max_train_pairs: null}`` with
    the run's ``env.num_heldout_tasks: 150, env.max_train_pairs: 150`` demonstrates only facts
    neither RL nor evaluation asks about (configs/search_qa_reading.yaml). Another world
    (``{seed: 1}``) also works mechanically, but its policy could not read the run's world
    (docs/results/demo.md). Empty: demonstrate the run's own training tasks."""
    seed: int = 0
    """Shuffling and init seed."""


class PolicyConfig(BaseModel):
    """Which model the run trains."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str = "builtin:tiny"
    """``builtin:tiny`` to create one locally, ``builtin:smollm2`` for SmolLM2-135M-Instruct
    converted from its Python package (``turnrl models list``; ``docs/pretrained.md``), or any
    Hugging Face model folder or hub id. SFT (``sft``) applies to the builtins only."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the builtin model."""
    sft: SFTConfig = SFTConfig()
    """Warm start."""
    cache_dir: str = ".cache/turnrl/policies"
    """Where bootstrapped policies are cached (relative paths are from the working dir)."""
    models_dir: str = ".cache/turnrl/models"
    """Where packaged pretrained models (``builtin:smollm2``) are converted to Hugging Face
    folders, once (``turnrl models convert NAME --dir`` writes the same place)."""


LLAMA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama- or Qwen2-style decoder block (attention and MLP)."""


class LoRAConfig(BaseModel):
    """Low-rank adapters: the learner trains only these, the base weights stay frozen
    (``learner/lora.py``; ``docs/lora.md``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(16, ge=1, le=1024)
    """r: the adapters' inner dimension (trainable parameters grow linearly with it: an adapted
    layer of in x out weights gets ``rank * (in + out)``)."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the adapter's update ``B @ A`` is multiplied by ``alpha / rank``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training (0: none; never applied to the
    published, merged weights nor to old or reference log-probs, computed in eval mode)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_LINEAR_MODULES), min_length=1)
    """Linear modules that get an adapter, by name or dotted suffix (``q_proj``,
    ``self_attn.o_proj``); each must match a linear module of the policy (checked when the
    learner builds it, listing the model's linear module names). Default: every attention and
    MLP projection of a Llama- or Qwen2-style block."""

    publish: Literal["adapter", "merged"] = "adapter"
    """What the learner publishes each version: ``adapter``, only the adapter's tensors, which
    engines serve beside the base (``rollout/engines/adapters.py``; every request of the run
    names the run's adapter; kilobytes to megabytes a version, not the model; a vLLM engine
    needs ``rollout.engine.max_loras`` >= 1); ``merged``, the whole model with the adapter
    folded in, for engines that serve no adapters and for model scorers that score with the
    policy's weights (``rewards.ig.scorer: model``)."""

    @model_validator(mode="after")
    def _unique_targets(self) -> "LoRAConfig":
        dupes = sorted({t for t in self.target_modules if self.target_modules.count(t) > 1})
        if dupes or any(not t.strip() for t in self.target_modules):
            raise ValueError(f"learner.lora.target_modules: names must be non-empty and distinct (repeated: "
                             f"{dupes}); list each module once")
        return self


class LearnerConfig(BaseModel):
    """The DeepSpeed learner."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    batch_groups: int = Field(4, ge=1)
    """B: groups per optimizer step."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each claimed batch. Every pass after the first is off-policy to the weights
    that computed the old log-probs, which is what the PPO clip bounds."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the batch's rows are split into this many contiguous parts
    (at most one per row). With ``ppo_epochs`` 1 and ``mini_batches`` 1 the batch takes one
    on-policy step: the ratio is exactly 1 and the clip never engages."""
    lr: float = Field(1e-4, ge=0)
    """AdamW learning rate. 0 runs every update but leaves the weights as they are
    (bench/pipeline.py: both modes then sample the same episodes' distribution)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision (fp16 is refused on CPU by DeepSpeed)."""
    estimator: EstimatorConfig = GRPOConfig()
    """Advantage estimator, selected by ``type``."""
    live_baseline: LiveBaselineConfig = LiveBaselineConfig()
    """Estimator of live sessions (groups of one, so no group baseline): a running baseline
    per reward source. Scheduled groups use ``estimator``."""
    loss: LossConfig = PPOLossConfig()
    """Policy loss, selected by ``type``."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a Hugging Face checkpoint and run state every N steps (0: only at the end)."""
    max_restarts: int = Field(2, ge=0)
    """Times a dead learner (its process killed, its node lost) is restarted inside the same
    run from its last checkpoint (``checkpoint_every``; without one, from the start) before
    the run fails. What the lost steps trained is delivered again by replay."""
    claim_timeout_s: float = Field(600.0, gt=0)
    """Longest the learner waits for a batch before the run fails (with ``train.source:
    live``, how long live traffic may pause)."""
    live_shortfall: Literal["train_rollouts", "wait"] = "train_rollouts"
    """``train.source: mixed`` only: a step whose rollout groups are ready while fewer live
    sessions than its share are. ``train_rollouts``: train on the rollout groups plus the
    sessions that are ready (a smaller batch; ``live/sessions_missing`` in the step's metrics
    says how many were missing), so the run never waits on traffic. ``wait``: wait for the
    full share, every batch the same mix, and fail the run after ``claim_timeout_s``."""
    num_cpus: float = Field(1.0, gt=0)
    """Ray CPUs reserved per learner rank."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved per learner rank (0 on CPU machines; 1 gives each rank a GPU of its
    own; a fraction lets a single rank share a GPU with an engine)."""
    resources: dict[str, float] = {}
    """Custom Ray resources each learner rank reserves (in its placement bundle), e.g.
    ``{trainer_node: 1}`` to keep the ranks on nodes that advertise it."""
    cpu_affinity: list[int] | None = None
    """Cores the learner ranks' processes may run on (Linux CPU affinity of every
    thread), e.g. to give generation and training disjoint cores on one machine; None: the OS
    schedules."""
    world_size: int = Field(1, ge=1)
    """Learner ranks (data parallel, one Ray actor each). Rank 0 alone claims, acknowledges,
    publishes and commits; every rank trains on its share of each batch's rows, and DeepSpeed
    averages their gradients, so the update is the one a single rank would take."""
    placement: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the ranks' bundles (``num_cpus`` + ``num_gpus`` each):
    PACK puts them on as few nodes as possible (gradient all-reduce over NVLink rather than
    the network), STRICT_PACK insists on one node."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy, the reference model, batches and the log Z table live; ``auto`` is
    ``cuda`` when the rank sees a GPU (``num_gpus`` > 0), else ``cpu``. The process group is
    NCCL on ``cuda`` and gloo on ``cpu``."""
    torch_threads: int = Field(2, ge=1)
    """Intra-op threads of each learner rank."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of holding them
    from the forward (Hugging Face's gradient checkpointing): the backward's peak memory drops by
    most of the activations (docs/results/learner_memory.md) for about one more forward pass of
    compute. The shared system-prompt pass is then off (checkpointed layers keep no KV cache)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the frozen policy instead of every weight (None: full
    fine-tuning). The weight sync still publishes whole (merged) weights; checkpoints hold the
    adapter and name the base (``docs/lora.md``)."""
    on_pool: bool = False
    """Train this run's adapter in its engine pool's learner (``rollout.pool``, a pool declared
    with a ``learner``: one process holding the base once, an adapter slot per run) instead of
    starting a learner of the run's own; the run then starts no process that holds the model.
    The run service sets it for runs on such pools (docs/tenants.md)."""

    @model_validator(mode="after")
    def _device_matches_gpus(self) -> "LearnerConfig":
        if self.device == "cuda" and self.num_gpus == 0:
            raise ValueError("learner.device=cuda but learner.num_gpus=0: Ray hides every GPU from an "
                             "actor that reserves none; set learner.num_gpus=1")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError(f"learner.device=cpu would leave the learner.num_gpus={self.num_gpus:g} GPUs "
                             "it reserves idle; set learner.num_gpus=0 or learner.device=auto")
        if self.world_size > 1 and 0 < self.num_gpus < 1:
            raise ValueError(f"learner.world_size={self.world_size} with learner.num_gpus={self.num_gpus:g}: "
                             "NCCL ranks cannot share a GPU; give each rank a whole one (num_gpus=1)")
        return self

    @model_validator(mode="after")
    def _what_a_pool_learner_trains(self) -> "LearnerConfig":
        if self.on_pool:
            refusal = pool_learner_refusal(self)
            if refusal:
                raise ValueError(f"learner.on_pool: {refusal}")
        return self

    @model_validator(mode="after")
    def _lora_under_zero_0_to_2(self) -> "LearnerConfig":
        if self.lora is not None and self.zero_stage == 3:
            raise ValueError("learner.lora with learner.zero_stage=3: LoRA runs are supported (and tested) "
                             "under ZeRO 0-2; set learner.zero_stage to 0, 1 or 2 (the frozen base is not "
                             "optimizer state, so ZeRO 2 already shards all there is)")
        return self


def pool_learner_refusal(cfg: LearnerConfig) -> str | None:
    """Why a pool's learner (``learner.pool``) cannot train a run with these settings, naming
    the field; None when it can: a LoRA adapter with on-policy PPO, one rank."""
    if cfg.lora is None:
        return "learner.lora: a run on a pool learner trains a LoRA adapter; set learner.lora"
    if cfg.lora.publish != "adapter":
        return "learner.lora.publish: the pool learner publishes adapters; set it to adapter"
    if cfg.loss.type != "ppo":
        return f"learner.loss.type {cfg.loss.type!r}: the pool learner trains the ppo loss"
    if cfg.ppo_epochs != 1 or cfg.mini_batches != 1:
        return ("learner.ppo_epochs and learner.mini_batches: the pool learner takes on-policy steps "
                "(one epoch, one mini-batch)")
    if cfg.loss.kl_coef > 0:
        return "learner.loss.kl_coef: the pool learner has no KL term yet; set it to 0"
    if cfg.world_size != 1:
        return "learner.world_size: the pool learner trains each adapter in one process; set it to 1"
    return None
