"""Environment configs: one pydantic model per environment type, joined on ``type``.

Imports only pydantic, so the driver and CLI can validate a run config without loading any
environment code (``envs.registry`` maps each ``type`` to its factory).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ServerLaunch(BaseModel):
    """What runs or is reached for an external server: a command the run starts, or a URL. The
    fields every kind of server (MCP, OpenEnv) shares; over the run service they are the
    operator's, never the submitter's."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The server's name in this config (and in the operator's allowlist): errors name it."""
    command: str | None = None
    """The program to start (``python``, ``uvx``, ``npx``, ``uvicorn`` ...)."""
    args: list[str] = []
    """Its arguments."""
    env: dict[str, str] = {}
    """Environment variables set for it, on top of a minimal environment (PATH, HOME ...)."""
    cwd: str | None = None
    """Its working directory (None: the run's)."""
    url: str | None = None
    """A server already running, instead of a command."""

    @model_validator(mode="after")
    def _check_launch(self) -> ServerLaunch:
        if self.command is not None and self.url is not None:
            raise ValueError(f"server {self.name!r}: set command (a process the run starts) or url, not both")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise ValueError(f"server {self.name!r}: args, env and cwd apply to a command, not to a url")
        return self

    def launchable(self) -> bool:
        """Whether it names what to start or reach (over the run service, the operator fills it)."""
        return self.command is not None or self.url is not None

    def process_env(self) -> dict[str, str]:
        """The started process's environment: ``env`` over a minimal one (no secrets of the run's)."""
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")
        return {k: os.environ[k] for k in keep if k in os.environ} | self.env


class McpServerConfig(ServerLaunch):
    """One MCP server whose tools the environment offers: a command the run starts (stdio, one
    process per environment actor, per episode when ``stateful``) or a URL it connects to
    (streamable HTTP, ``http://host:port/mcp``). Over the run service, only ``name`` is submitted:
    the operator's ``admission.mcp_servers`` entry of that name supplies the rest."""

    tools: list[str] | None = None
    """Only these of its tools are offered (None: every tool ``list_tools`` returns)."""
    call_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """Wall-clock limit of one tool call; past it the call fails as an observation."""
    stateful: bool = False
    """True: each episode gets a server of its own (tools that keep state between calls, such
    as a scratch database); False: one server per environment actor, shared by its episodes."""


McpServers = Annotated[list[McpServerConfig], Field(default=[])]


def check_mcp_servers(servers: list[McpServerConfig]) -> None:
    """Server names are unique within an environment."""
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"mcp names a server twice ({names}): give each a name of its own")


class SearchQAConfig(BaseModel):
    """Search-QA: the built-in synthetic world, or real question/corpus files (``data``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["search_qa"] = "search_qa"
    """Selects this environment."""
    seed: int = 0
    """Seed of the synthetic world and of its task split; same seed, same tasks and ids."""
    num_entities: int = Field(default=120, ge=20, le=5000)
    """Synthetic world size: about 7% countries, 20% cities, 20% companies, the rest people."""
    hops: list[int] = Field(default=[1, 2], min_length=1)
    """Question hop counts to generate (each 1, 2 or 3)."""
    hop_weights: list[float] | None = None
    """Relative share of each entry of ``hops`` in both splits; None means equal shares."""
    top_k: int = Field(default=2, ge=1, le=50)
    """Documents returned by one search call."""
    passages: Literal["entity", "fact"] = "entity"
    """Synthetic world only. What one search result is: ``entity``, an entity's whole document;
    ``fact``, one fact of it ("Kavo Tulen works for: Zeltra."), like a passage-level index that
    returns the best-matching snippet. With ``fact`` the gold search names the relation too
    ("Kavo Tulen works for"), and the answer is the retrieved passage's last name."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Assistant turns before the episode ends without an answer."""
    extra_turns: int | None = Field(default=None, ge=1, le=63)
    """Synthetic world only. None: every question may take ``max_turns`` turns. N: a question
    of h hops may take h + N (one search per hop, the answer, N - 1 spare turns), so a 1-hop
    question cannot wander as long as a 3-hop one; ``max_turns`` must then be at least
    max(hops) + N."""
    num_train_tasks: int = Field(default=2000, ge=1)
    """Train tasks; once every train wording was used, they repeat in a new order."""
    num_heldout_tasks: int = Field(default=200, ge=0)
    """Held-out tasks, about (entity, relation chain) pairs no train task asks about."""
    max_train_pairs: int | None = Field(default=None, ge=1)
    """Synthetic world only. At most this many (entity, relation chain) pairs per hop count feed
    the train split: the first ones after the held-out cut of the seeded shuffle. With
    ``policy.sft.env: {num_heldout_tasks: H + N, max_train_pairs: null}`` the warm start
    demonstrates only pairs beyond the ones RL trains on: SFT, RL and held-out pairs disjoint.
    None: every pair not held out."""
    train_worlds: int = Field(default=0, ge=0, le=1000)
    """0: train and held-out questions share the world of ``seed`` (split by entity and relation
    chain). N > 0: train questions come from N other worlds (seeds ``seed + 1 .. seed + N``),
    each searching its own documents, and held-out questions (the same ones as with 0) from the
    world of ``seed``, whose facts no training task or demonstration shows: nothing recalled
    from training answers a held-out question, only searching and reading transfer."""
    data: SearchDataConfig | None = None
    """Real question and corpus files instead of the synthetic world."""
    mcp: McpServers
    """MCP servers whose tools every task offers beside ``search`` (``docs/envs.md``)."""

    @model_validator(mode="after")
    def _check(self) -> SearchQAConfig:
        bad = [h for h in self.hops if h not in (1, 2, 3)]
        if bad or len(set(self.hops)) != len(self.hops):
            raise ValueError(f"hops must be distinct values among 1, 2, 3; got {self.hops}")
        if self.hop_weights is not None:
            if len(self.hop_weights) != len(self.hops) or min(self.hop_weights) < 0:
                raise ValueError(
                    f"hop_weights needs one non-negative weight per entry of hops {self.hops}; "
                    f"got {self.hop_weights}"
                )
            if sum(self.hop_weights) <= 0:
                raise ValueError("hop_weights must not all be zero")
        if self.data is not None:
            synthetic_only = ("passages", "max_train_pairs", "train_worlds", "extra_turns")
            fields = type(self).model_fields
            set_here = [k for k in synthetic_only if getattr(self, k) != fields[k].default]
            if set_here:
                raise ValueError(
                    f"{', '.join(set_here)} only shape the synthetic world, and env.data replaces it: "
                    "remove them, or remove env.data to use the synthetic world"
                )
        if self.data is None and self.max_turns < max(self.hops) + 1:
            raise ValueError(
                f"max_turns={self.max_turns} is too few for {max(self.hops)}-hop questions: "
                f"set max_turns >= {max(self.hops) + 1} (one search per hop, then the answer)"
            )
        if self.extra_turns is not None and self.max_turns < max(self.hops) + self.extra_turns:
            raise ValueError(
                f"extra_turns={self.extra_turns} gives {max(self.hops)}-hop questions "
                f"{max(self.hops) + self.extra_turns} turns, more than max_turns={self.max_turns}: "
                f"set max_turns >= {max(self.hops) + self.extra_turns}"
            )
        return self

    def turn_limit(self, hops: int | None) -> int:
        """Assistant turns a question of ``hops`` hops may take (``extra_turns``)."""
        if self.extra_turns is None or hops is None:
            return self.max_turns
        return hops + self.extra_turns

    def weights(self) -> list[float]:
        """Hop weights with the default (equal shares) filled in."""
        return list(self.hop_weights) if self.hop_weights else [1.0] * len(self.hops)


class SearchDataConfig(BaseModel):
    """Real-format search-QA data: Search-R1 / FlashRAG question files and a JSONL corpus."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    train_path: str
    """Train questions: JSONL or parquet records with ``question`` and ``golden_answers``."""
    heldout_path: str
    """Held-out questions, same layout (e.g. NQ ``test`` or HotpotQA ``dev``)."""
    corpus_path: str
    """Corpus JSONL: one ``{"id": ..., "contents": "\\"Title\\"\\ntext"}`` per line."""
    retriever: Literal["bm25", "dense"] = "bm25"
    """BM25 (bm25s) or dense cosine retrieval with a local sentence-transformers model."""
    dense_model_path: str | None = None
    """Local directory of a sentence-transformers model; required when retriever is dense."""
    index_cache_dir: str | None = ".cache/search_index"
    """Where indexes are cached, keyed by corpus hash; None rebuilds every time."""
    max_train_tasks: int | None = Field(default=None, ge=1)
    """Keep only the first N train records (None keeps all)."""
    max_heldout_tasks: int | None = Field(default=None, ge=1)
    """Keep only the first N held-out records (None keeps all)."""

    @model_validator(mode="after")
    def _check(self) -> SearchDataConfig:
        if self.retriever == "dense" and not self.dense_model_path:
            raise ValueError("retriever 'dense' needs dense_model_path (a local model directory)")
        return self


SearchQAConfig.model_rebuild()


class ToolUseConfig(BaseModel):
    """Tool use: built-in calculator/conversion/look-up tasks, or MatchTIR/FTRL task files."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["tool_use"] = "tool_use"
    """Selects this environment."""
    seed: int = 0
    """Seed of the built-in task generator; same seed, same tasks and ids."""
    num_train_tasks: int = Field(default=1000, ge=1)
    """Built-in train tasks (distinct questions)."""
    num_heldout_tasks: int = Field(default=100, ge=0)
    """Built-in held-out tasks; no question is in both splits."""
    min_calls: int = Field(default=2, ge=2, le=4)
    """Fewest tool calls a built-in task's gold trace makes."""
    max_calls: int = Field(default=4, ge=2, le=4)
    """Most tool calls a built-in task's gold trace makes."""
    max_turns: int = Field(default=6, ge=1, le=64)
    """Assistant turns before the episode ends without an answer."""
    tool_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Wall-clock limit of one tool call; past it the call is killed and reported."""
    tool_memory_mb: int = Field(default=256, ge=64, le=65536)
    """Address-space limit of a tool process."""
    train_path: str | None = None
    """MatchTIR/FTRL-layout train file (JSONL/JSON/parquet) instead of built-in tasks."""
    heldout_path: str | None = None
    """Held-out file in the same layout; set both paths or neither."""
    mcp: McpServers
    """MCP servers whose tools every task offers besides its own (``docs/envs.md``)."""

    @model_validator(mode="after")
    def _check(self) -> ToolUseConfig:
        check_mcp_servers(self.mcp)
        if (self.train_path is None) != (self.heldout_path is None):
            raise ValueError("set both train_path and heldout_path, or neither (built-in tasks)")
        if self.min_calls > self.max_calls:
            raise ValueError(f"min_calls={self.min_calls} exceeds max_calls={self.max_calls}")
        if self.train_path is None and self.max_turns < self.max_calls + 1:
            raise ValueError(
                f"max_turns={self.max_turns} cannot fit {self.max_calls} calls and an answer: "
                f"set max_turns >= {self.max_calls + 1}"
            )
        return self


class HouseholdConfig(BaseModel):
    """Household: an ALFWorld-like text world of rooms, containers and object states."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["household"] = "household"
    """Selects this environment."""
    seed: int = 0
    """Base seed; each task is one world seed, so a task always starts from the same state."""
    num_train_tasks: int = Field(default=1000, ge=1)
    """Train tasks (world seeds)."""
    num_heldout_tasks: int = Field(default=100, ge=0)
    """Held-out tasks, from world seeds no train task uses."""
    max_turns: int = Field(default=30, ge=5, le=100)
    """Actions before the episode ends unsolved."""
    success_reward: float = 10.0
    """Environment reward of the step that achieves the goal."""
    invalid_penalty: float = -0.1
    """Environment reward of an invalid (inadmissible or malformed) action."""
    goal_types: list[Literal["place", "clean", "heat", "cool"]] = Field(
        default=["place", "clean", "heat", "cool"], min_length=1
    )
    """Goal kinds to generate: put X in R, put a clean/hot/cold X in R."""
    visible_items: bool = False
    """Room descriptions list what each receptacle holds (``countertop 1 (mug 1)``), closed
    ones included, so the agent can see where objects are in the room it stands in. Off: as
    in ALFWorld, objects show only at their receptacle, and the planner's demonstrations go
    straight to places the agent cannot know (a policy imitating them guesses)."""
    other_rooms: int = Field(default=3, ge=0, le=3)
    """Most rooms besides the kitchen: each world has between 1 and this many (0: the kitchen
    alone, about ten receptacles, where a "place" plan is 3-6 actions). Smaller worlds give
    shorter observations and admissible lists, so episodes and training rows cost less."""
    mcp: McpServers
    """MCP servers whose tools every task offers beside the world's actions (``docs/envs.md``)."""


class BfclConfig(BaseModel):
    """BFCL v4 (Berkeley Function Calling Leaderboard) tasks, scored by bfcl_eval's checkers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["bfcl"] = "bfcl"
    """Selects this environment."""
    categories: list[Literal[
        "simple_python", "multiple", "parallel", "parallel_multiple",
        "multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context",
    ]] = Field(default=["simple_python", "multiple", "parallel", "multi_turn_base"], min_length=1)
    """BFCL v4 categories to load: single-turn ones are one decision (AST checker), multi-turn
    ones execute BFCL's API classes (state and response checkers). Not offered: Java/JavaScript,
    live (user-contributed), irrelevance, web search, memory, format sensitivity and
    multi_turn_miss_func (docs/envs.md says why)."""
    heldout_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of each category held out, chosen by a hash of the task id, not by file order."""
    split_seed: int = 0
    """Salt of that hash: another value draws another split."""
    max_tasks_per_category: int | None = Field(default=None, ge=1)
    """Keep at most this many tasks of each category in each split (the lowest hashes; None:
    all), for short runs."""
    max_turns: int = Field(default=24, ge=1, le=400)
    """Assistant turns before the episode ends; a multi-turn task not finished by then fails,
    as BFCL fails a force-terminated entry."""
    max_steps_per_turn: int = Field(default=20, ge=1, le=100)
    """Call steps in one user turn before the episode is force-quit (BFCL's
    MAXIMUM_STEP_LIMIT, 20)."""
    tool_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Wall-clock limit of one step's calls; past it the episode's worker process is killed, the
    step fails, and the next step replays the episode into a fresh process."""
    check_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """Wall-clock limit of one multi-turn verdict (it re-executes the episode's calls and the
    ground truth); past it the episode counts as failed."""
    tool_memory_mb: int = Field(default=1024, ge=128, le=65536)
    """Address-space limit of a BFCL worker process (Python plus BFCL's API classes)."""
    mcp: McpServers
    """MCP servers whose tools every task offers beside its functions (``docs/envs.md``)."""


class ReasoningGymTask(BaseModel):
    """One reasoning-gym task family in the mix."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """A reasoning-gym dataset name (``basic_arithmetic``, ``chain_sum``, ``countdown`` ...;
    ``reasoning_gym.factory.DATASETS`` lists them)."""
    weight: float = Field(default=1.0, gt=0)
    """Relative share of this family's questions in both splits."""
    config: dict[str, Any] = {}
    """Keyword arguments of the family's config class (difficulty ranges and the like), as
    reasoning-gym names them; ``seed`` and ``size`` are TurnRL's (set from the env's)."""

    @model_validator(mode="after")
    def _check(self) -> ReasoningGymTask:
        taken = sorted({"seed", "size"} & set(self.config))
        if taken:
            raise ValueError(f"config sets {taken}: the environment sets them (env.seed, "
                             "env.num_train_tasks, env.num_heldout_tasks); remove them")
        return self


class ReasoningGymConfig(BaseModel):
    """reasoning-gym's procedural task families, scored by each family's own scorer."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Selects this environment."""
    tasks: list[ReasoningGymTask] = Field(min_length=1)
    """The task families and their shares."""
    seed: int = 0
    """Seed of the generators: train and held-out questions come from different seeds (and a
    train question whose text is a held-out one is dropped)."""
    num_train_tasks: int = Field(default=1000, ge=1)
    """Train questions, split between families by weight."""
    num_heldout_tasks: int = Field(default=100, ge=0)
    """Held-out questions, split the same way."""
    tools: list[Literal["python"]] = []
    """Tools offered: ``python`` runs the model's code in the tool sandbox (``envs.tool_use``'s
    limited process) and shows what it printed. None: a single-turn question."""
    max_turns: int | None = Field(default=None, ge=1, le=64)
    """Assistant turns; None (the default): 1 without tools, 4 with them, filled in when the config is read."""
    tool_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Wall-clock limit of one python call; past it the call is killed and reported."""
    tool_memory_mb: int = Field(default=256, ge=64, le=65536)
    """Address-space limit of a python call's process."""
    mcp: McpServers
    """MCP servers whose tools every question offers (``docs/envs.md``)."""

    @model_validator(mode="after")
    def _check(self) -> ReasoningGymConfig:
        check_mcp_servers(self.mcp)
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks names a family twice ({names}): give each family once, with its weight")
        if (self.tools or self.mcp) and self.max_turns == 1:
            raise ValueError("max_turns=1 leaves no turn to answer after a tool call: "
                             "set max_turns >= 2, or tools: []")
        if self.max_turns is None:  # filled in here, so every reader sees a number
            self.max_turns = 4 if self.tools or self.mcp else 1
        return self


class OpenEnvServerConfig(ServerLaunch):
    """Where an OpenEnv environment server runs: a local process the run starts (one per
    environment actor, started again if it dies; ``{port}`` in ``command`` or ``args`` becomes a
    free loopback port, e.g. ``["-m", "uvicorn", "my_env.server.app:app", "--port", "{port}"]``)
    or a URL (``http://host:8000``). Over the run service, only ``name`` is submitted: the
    operator's ``admission.openenv_servers`` entry of that name supplies the rest."""

    start_timeout_s: float = Field(default=60.0, gt=0, le=600)
    """Seconds for a started server to answer ``GET /health``."""


class OpenEnvConfig(BaseModel):
    """An OpenEnv environment (``reset``/``step`` over its WebSocket protocol) as episodes and turns."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["openenv"] = "openenv"
    """Selects this environment."""
    server: OpenEnvServerConfig
    """The environment server."""
    action: Literal["tool", "text"] = "tool"
    """How a reply becomes an action. ``tool``: the server's action schema (``GET /schema``) is
    offered as one tool, ``tool_name``, whose call's arguments are the action. ``text``: the
    reply's text is the action's ``text_field``."""
    tool_name: str = Field(default="step", pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
    """The tool's name with ``action: tool``."""
    tool_description: str = "Take an action in the environment."
    """The tool's description with ``action: tool``."""
    text_field: str = "message"
    """The action field the reply's text fills with ``action: text``."""
    observation_field: str | None = None
    """The observation field shown to the policy (None: every field but done, reward and
    metadata, as JSON; a lone text field as its text)."""
    system_prompt: str = "You are acting in an environment. Each message shows what it returned; act until it ends."
    """The system message of every episode."""
    seed: int = Field(default=0, ge=0)
    """Train episodes reset with seeds ``seed * 10**7 + i`` and held-out ones with the seeds
    after them: the splits never share a seed."""
    num_train_tasks: int = Field(default=1000, ge=1, le=10**6)
    """Train episodes (reset seeds)."""
    num_heldout_tasks: int = Field(default=100, ge=0, le=10**6)
    """Held-out episodes (reset seeds)."""
    reset_args: dict[str, Any] = {}
    """Extra keyword arguments of every ``reset`` (the environment's own: difficulty, task name ...)."""
    max_turns: int = Field(default=16, ge=1, le=400)
    """Assistant turns before the episode ends (done or not)."""
    step_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """Seconds for ``reset`` or one ``step`` to answer; past it the episode fails with that cause."""
    success_at: float = 1.0
    """An episode whose rewards sum to at least this counts as a success."""


class CustomEnvConfig(BaseModel):
    """Your own environment: a task source you wrote against ``envs.base`` (``docs/envs.md``,
    "Bring your environment"), built by a function you name."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["custom"] = "custom"
    """Selects this environment."""
    source: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """``package.module:name``: a callable (a TaskSource class or a function) that takes ``args``
    as keyword arguments and returns an ``envs.base.TaskSource``. Imported in every process that
    runs episodes, so its module must be importable there. Over the run service, only one of the
    operator's ``admission.env_sources``."""
    args: dict[str, Any] = {}
    """Keyword arguments of ``source``."""


class VerifiersConfig(BaseModel):
    """A verifiers environment (its classic API: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``
    ...), loaded by its own ``load_environment`` and played turn by turn (``docs/envs.md``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["verifiers"] = "verifiers"
    """Selects this environment."""
    id: str = Field(pattern=r"^([\w.-]+/)?[A-Za-z_][\w.-]*$")
    """The environment's id as ``verifiers.load_environment`` takes it: an importable module
    (``my_env``, ``pkg.my_env``, or ``owner/my-env`` for the installed module ``my_env``) whose
    ``load_environment(**args)`` returns the environment. Over the run service, only one of the
    operator's ``admission.verifiers_envs``."""
    args: dict[str, Any] = {}
    """Keyword arguments of its ``load_environment``."""
    num_train_tasks: int | None = Field(default=None, ge=1)
    """Train tasks: the first this many rows of its dataset (None: every row)."""
    num_heldout_tasks: int | None = Field(default=100, ge=0)
    """Held-out tasks: the first this many rows of its ``eval_dataset`` (or of the rows set
    aside from its dataset when it has none); None: all of them."""
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1)
    """With no ``eval_dataset``: the share of its dataset's rows set aside (shuffled with
    ``seed``) as held-out tasks; a train row whose prompt is a held-out one's is dropped."""
    seed: int = 0
    """Seed of that split."""
    max_turns: int = Field(default=8, ge=1, le=400)
    """Assistant turns of an environment that sets no limit of its own (its ``max_turns`` <= 0);
    one that sets a limit keeps it."""
    step_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """Seconds the environment may take to answer a turn (its ``env_response``, its tools) or to
    score the episode; past it the episode fails with that cause."""
    success_at: float | None = None
    """An episode whose rubric reward is at least this counts as a success; None: the
    environment's own ``pass_threshold``."""


class McpTasksConfig(BaseModel):
    """Prompts answered with the tools of MCP servers, checked on the final answer and/or the
    tool-call trace (``docs/envs.md``, "Tools from MCP servers")."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["mcp_tasks"] = "mcp_tasks"
    """Selects this environment."""
    mcp: list[McpServerConfig] = Field(min_length=1)
    """The MCP servers whose tools the tasks use."""
    train_path: str
    """Train tasks: YAML (a list) or JSONL, one record per task: ``prompt`` (or ``messages``),
    and at least one check: ``answers`` (accepted final answers) and/or ``expect_calls``
    (calls the trace must contain); optional ``id``, ``system`` and ``gold_calls`` (the reference
    trace MatchTIR scores against; ``expect_calls`` when absent)."""
    heldout_path: str
    """Held-out tasks, same layout."""
    system_prompt: str = ("Use the tools to solve the task, one step at a time, then give the final "
                          "answer inside <answer></answer>.")
    """The system message of a task that gives none (``system``)."""
    max_turns: int = Field(default=6, ge=1, le=64)
    """Assistant turns before the episode ends without an answer."""

    @model_validator(mode="after")
    def _check(self) -> McpTasksConfig:
        check_mcp_servers(self.mcp)
        return self


EnvConfig = Annotated[SearchQAConfig | ToolUseConfig | HouseholdConfig | BfclConfig | ReasoningGymConfig | McpTasksConfig
                     | OpenEnvConfig | VerifiersConfig | CustomEnvConfig,
                      Field(discriminator="type")]
"""Any environment's config, chosen by its ``type`` field."""
