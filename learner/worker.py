"""The DeepSpeed learner: claim a batch, compute turn advantages, take ``ppo_epochs`` x
``mini_batches`` optimizer steps against old log-probs computed once, publish the new weights
(the weight sync acknowledges the batch once the engines serve them), checkpoint, commit.

Exactly-once training across crashes: every step appends its group ids to
``trained_groups.jsonl``; a checkpoint commits the acknowledged groups in the replay store;
on resume the log is cut back to the checkpoint's step, and the driver has the store deliver
again what later steps trained (their update died with the learner).

A learner of several ranks (``learner.world_size``) runs one worker per rank. Rank 0 alone
talks to replay and the weight sync: it claims the batch and hands every rank the same
trajectories over a gloo control group; each rank computes the (cheap, deterministic)
advantages of the whole batch, trains on its contiguous share of each mini-batch's rows with
shares of the *whole* mini-batch's tokens, and DeepSpeed averages the gradients: the update
is the one a single rank takes. Rank 0 then publishes to the weight sync, which acknowledges
the batch once the engines serve the new version, and commits at checkpoints.

Plain Python; the driver wraps it with ``ray.remote``. Stages of ``train_step`` are timed
(``wait``, ``advantages``, ``update``, ``publish``) and returned as metrics.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.advantages.assemble import BatchAdvantages
from learner.checkpoints import checkpoint_tag, load_log_z, resume_state, save_local, upload_checkpoint, write_state
from learner.batching import TokenBatch, build_token_batch, by_length, micro_share, rank_micro_batches
from learner.config import LearnerConfig
from learner.deepspeed_setup import DistSpec, control_group, full_state_dict, init_engine, resolve_device
from learner import lora
from learner.losses import LossInputs, log_rewards, make_log_z, policy_loss
from learner.ports import LearnerPorts, claim_batch
from learner.run_files import keep_steps_through, log_trained
from learner.step_metrics import batch_metrics, signal_metrics
from replay.base import Claim
from replay.client import wait_claim
from storage import RunStorage, node_copy
from rollout.next_token import next_token_logprobs
from rollout.shared_prefix import shared_length
from rewards.config import RewardsConfig
from rollout.trajectory import Trajectory


class LearnerWorker:
    def __init__(self, cfg: LearnerConfig, model_path: str, run_dir: str, ports: LearnerPorts,
                 *, group_size: int, temperature: float, resume: bool = False,
                 live_groups: int = 0, dist: DistSpec | None = None, storage_url: str | None = None,
                 version_floor: int = 0, rewards: RewardsConfig | None = None) -> None:
        """``ports`` are used by rank 0 only; ``dist`` places this worker in a multi-rank
        learner (None: the only rank). ``storage_url``: where checkpoints and run state are
        uploaded and resumed from (``cluster.storage``; None: ``run_dir`` is the record).
        ``version_floor``: for a learner restarted inside a running job, the newest version
        the engines already serve; versions continue above it (engines only ever move
        forward), starting with the checkpoint's weights published as the next one.
        ``rewards``: the run's reward config, whose trained sources and weights the estimator
        reads and whose ``on_missing`` handles failed scorers (None: the estimator's own
        sources, ``mask_turn``)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(cfg.torch_threads)
        self.cfg, self.ports, self.temperature = cfg, ports, temperature
        self.rank, self.world = (dist.rank, dist.world_size) if dist else (0, 1)
        self.device = resolve_device(cfg)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # on a node of its own, a local scratch copy
        self.store = RunStorage(storage_url) if storage_url else None
        self.base = str(Path(model_path).resolve()) if Path(model_path).exists() else model_path
        """The policy this run started from, as its LoRA checkpoints name it."""
        model_path = node_copy(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        state = resume_state(self.store, self.run_dir) if resume else None
        # A LoRA checkpoint holds only the adapter: its base is the run's policy, and the
        # DeepSpeed checkpoint loaded below restores the adapter and its optimizer state.
        load_from = state["hf_path"] if state and cfg.lora is None else model_path
        model = AutoModelForCausalLM.from_pretrained(load_from, dtype=torch.float32)
        if cfg.gradient_checkpointing:
            checkpoint_layers(model)
        if cfg.lora is not None:
            model = lora.wrap(model, cfg.lora)
        self.kl_to_ref = cfg.loss.type == "ppo" and cfg.loss.kl_coef > 0
        self.ref = None  # under LoRA the reference is the policy with its adapters disabled
        if self.kl_to_ref and cfg.lora is None:
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device).eval()
        self.live_groups = live_groups
        """Live groups (sessions, one trajectory each) in every claimed batch; the rest are
        scheduled groups of ``group_size``."""
        self.rows = (cfg.batch_groups - live_groups) * group_size + live_groups
        self.advantages = BatchAdvantages.of_run(cfg, rewards, state)
        """The batch's advantages; its running live baselines per reward source are checkpointed."""
        self._interrupted = threading.Event()
        self.micro_batches = math.ceil(self.rows / cfg.micro_batch_size)
        self.ds_engine = init_engine(model, cfg, self.micro_batches, self.device, dist)
        """DeepSpeed's engine around the policy being trained (not an inference engine: those
        are ``rollout.engines``, which serve the weights this one publishes)."""
        # Objects between ranks; it waits as long as rank 0 may wait for a batch.
        self.control = control_group(cfg.claim_timeout_s + 120) if self.world > 1 else None
        # Trajectory balance's learned log Z: a table per task, in its own optimiser at its
        # own (much higher) learning rate, stepped with the policy.
        self.log_z = make_log_z(cfg.loss) if cfg.loss.type == "trajectory_balance" else None
        if self.log_z is not None:
            self.log_z.to(self.device)
        self.log_z_opt = (torch.optim.Adam(self.log_z.parameters(), lr=cfg.loss.log_z_lr)
                          if self.log_z is not None else None)
        self.task_codes: dict[str, int] = {}
        # Metrics of each optimizer step of the last batch (one per epoch x mini-batch).
        self.update_metrics: list[dict[str, float]] = []
        self.version = state["version"] if state else 0
        self.step = state["step"] if state else 0
        self.resumed_from = (self.step, self.version)
        """(step, version) of the checkpoint this learner started from ((0, 0): none)."""
        if version_floor:
            self.version = max(self.version, version_floor) + 1
        self.trained_log = self.run_dir / "trained_groups.jsonl"
        self._published_mb = 0.0
        """Size of the last state dict published (rank 0): the model, or a LoRA run's adapter."""
        if state:
            # a LoRA checkpoint's module state is the adapter alone (the base is model_path's)
            self.ds_engine.load_checkpoint(str(self.run_dir / "ds_checkpoint"), tag=state["ds_tag"],
                                           load_module_only=False, load_module_strict=cfg.lora is None)
            if self.log_z is not None:
                self.task_codes = load_log_z(self.run_dir, state["ds_tag"], self.log_z, self.log_z_opt, self.device)
        if state or version_floor:
            if self.rank == 0:
                keep_steps_through(self.trained_log, self.step)  # later steps are trained again
        if state or version_floor or self._publishes_adapter:
            # engines serve a LoRA run's requests only with its adapter loaded: version 0 too
            self._publish()

    # -- one step ------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step on every rank (each rank's driver call runs this); rank 0's metrics
        describe the step."""
        t0 = time.perf_counter()
        claim, trajs = self._batch()
        t1 = time.perf_counter()
        metrics = self._update(trajs)
        t2 = time.perf_counter()
        self.version += 1
        self.step += 1
        # The weight sync acknowledges the claim once the engines serve the new version; with
        # no checkpoint to resume from, nothing to retain: forgotten in the same call.
        self._publish(None if claim is None else (claim.claim_id, not self.cfg.checkpoint_every))
        if claim is not None:  # rank 0
            self._log_trained(claim)
        t3 = time.perf_counter()
        if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        metrics |= batch_metrics(trajs, claim.staleness if claim else [])
        if self.live_groups:  # the live share this step went without (live_shortfall: train_rollouts)
            metrics["live/sessions_missing"] = self.live_groups - metrics["live/trained_sessions"]
        metrics |= {"step": self.step, "version": self.version, "time/wait_s": t1 - t0,
                    "time/update_s": t2 - t1, "time/publish_s": t3 - t2, "weights/published_mb": self._published_mb,
                    "time/step_s": time.perf_counter() - t0}
        return metrics

    def _batch(self) -> tuple[Claim | None, list[Trajectory]]:
        """Rank 0 claims the batch; every other rank receives its trajectories, or its
        failure to claim, which it raises too."""
        if self.rank > 0:
            got = self._from_rank0(None)
            if isinstance(got, tuple):
                kind, message = got
                raise {"InterruptedError": InterruptedError, "TimeoutError": TimeoutError}.get(
                    kind, RuntimeError)(f"learner rank 0: {message}")
            return None, got
        try:
            claim = self._claim()
        except Exception as exc:
            self._from_rank0((type(exc).__name__, str(exc)))
            raise
        trajs = [t for g in claim.groups for t in g.trajectories]
        self._from_rank0(trajs)
        return claim, trajs

    def _from_rank0(self, obj: Any) -> Any:
        """``obj`` of rank 0, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _claim(self) -> Claim:
        wait_for_live = self.cfg.live_shortfall == "wait"
        claim = wait_claim(lambda n, wait_s: claim_batch(self.ports, n, self.live_groups, wait_for_live, wait_s),
                           self.cfg.batch_groups, self.cfg.claim_timeout_s, should_stop=self._interrupted.is_set)
        if claim is None and self._interrupted.is_set():
            raise InterruptedError("the learner was told to stop waiting for a batch (the run is ending)")
        if claim is None:
            needs_live = self.live_groups and (wait_for_live or self.live_groups == self.cfg.batch_groups)
            raise TimeoutError(
                f"learner waited {self.cfg.claim_timeout_s:.0f}s for {self.cfg.batch_groups} groups "
                f"({self.live_groups} of them live sessions): "
                + ("no live sessions were recorded into replay (is traffic reaching the live "
                   "endpoint, and are sessions ended or given feedback?) or " if needs_live else "")
                + "rollout actors are not producing (see their errors above) or replay refuses "
                "them; learner.claim_timeout_s sets the wait")
        return claim

    def _publish(self, ack: tuple[str, bool] | None = None) -> None:
        """The current weights to the weight sync (gathered on every rank under ZeRO-3, sent
        by rank 0), which acknowledges ``ack`` = (claim id, commit) once engines serve them."""
        only = lora.is_adapter_tensor if self._publishes_adapter else None
        state = full_state_dict(self.ds_engine, gather_to_all=False, only=only)
        if self.rank == 0:
            if self._publishes_adapter:
                state = lora.adapter_state(state)
            elif self.cfg.lora is not None:  # engines load whole weights under the base's names
                state = lora.merged_state(state, self.cfg.lora)
            self._published_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
            self.ports.publish(self.version, state, ack)

    @property
    def _publishes_adapter(self) -> bool:
        return self.cfg.lora is not None and self.cfg.lora.publish == "adapter"

    def republish(self) -> int:
        """Rank 0: the last published weights to the weight sync again (the driver calls it
        in the ``control`` group when the sync was restarted, possibly beside a step);
        returns their version."""
        return self.ports.republish() if self.rank == 0 else 0

    def weight_group(self) -> dict[str, Any] | None:
        """Rank 0: the weight broadcast group's address (``rollout.weights.transport:
        broadcast``) for the driver's start step; None on other transports and ranks."""
        if self.rank > 0 or not hasattr(self.ports, "publisher"):
            return None
        return getattr(self.ports.publisher(), "init", None)

    def join_weight_group(self) -> None:
        """Rank 0: form the weight broadcast group, as every engine joins it at the same time
        (the driver's start step); returns once all have."""
        self.ports.publisher().join()

    def settle_weights(self) -> None:
        """Rank 0: wait until the last published version is served and its batch acknowledged."""
        if self.rank == 0:
            self.ports.settle()

    def _update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """Advantages, then ``ppo_epochs`` x ``mini_batches`` optimizer steps on the batch.

        Old log-probs are computed once, before the first step, so later steps' ratios
        measure how far the policy has moved and the clip engages. With one epoch and one
        mini-batch the single step is on-policy: the old log-probs are the current ones,
        detached, without a second forward pass (today's behaviour, exactly)."""
        t0 = time.perf_counter()
        trajs, res, mask = self.advantages(trajs)
        tb = build_token_batch(trajs, res.advantages, mask, self.tokenizer.pad_token_id,
                               res.clip_low, res.clip_high)
        t1 = time.perf_counter()
        n_rows = tb.input_ids.size(0)
        if self.cfg.mini_batches > n_rows:
            raise ValueError(f"learner.mini_batches={self.cfg.mini_batches} exceeds the batch's "
                             f"{n_rows} rows; lower it (at most one mini-batch per row)")
        parts = [(int(p[0]), int(p[-1]) + 1) for p in np.array_split(np.arange(n_rows), self.cfg.mini_batches)]
        tb = by_length(tb, parts, self.world)
        task_ids, log_r = self._tb_rows(trajs, tb)
        old = None
        if self.cfg.ppo_epochs * self.cfg.mini_batches > 1:
            old = self._old_logprobs(tb, parts)
        t2 = time.perf_counter()
        self.ds_engine.train()
        self.update_metrics = [self._optimizer_step(tb, start, stop, old, task_ids, log_r)
                               for _ in range(self.cfg.ppo_epochs) for start, stop in parts]
        return {**_combine_updates(self.update_metrics),
                "loss/updates": float(len(self.update_metrics)),
                "adv/mean": float(res.advantages[mask].mean()) if mask.any() else 0.0,
                "adv/abs_mean": float(np.abs(res.advantages[mask]).mean()) if mask.any() else 0.0,
                **signal_metrics(trajs, res.advantages, mask),
                "time/advantages_s": t1 - t0, "time/old_logprobs_s": t2 - t1,
                "tokens/trained": tb.num_tokens,
                "tokens/rows": float(n_rows), "tokens/row_width": float(tb.input_ids.size(1))}

    def _spans(self, start: int, stop: int) -> list[tuple[int, int] | None]:
        """This rank's micro-batches of rows ``start:stop`` (None: a zero-weight step that
        keeps the ranks' collectives in step)."""
        return rank_micro_batches(start, stop, self.rank, self.world, self.cfg.micro_batch_size)

    def _old_logprobs(self, tb: TokenBatch, parts: list[tuple[int, int]]) -> torch.Tensor:
        """``[N, L-1]`` log-probs under the weights before this batch's first step, of the
        rows this rank trains (no grad, eval mode so dropout cannot make them noisy)."""
        old = torch.zeros(tb.loss_mask.shape, dtype=torch.float32, device=self.device)
        self.ds_engine.eval()
        with torch.no_grad():
            for start, stop in parts:
                for span in self._spans(start, stop):
                    a, b = span or (start, start + 1)
                    logp, _ = self._token_logprobs(tb.rows(a, b).to(self.device))
                    if span is not None:
                        old[a:b, :logp.size(1)] = logp
        return old

    def _optimizer_step(self, tb: TokenBatch, start: int, stop: int, old: torch.Tensor | None,
                        task_ids: torch.Tensor | None, log_r: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step on rows ``start:stop``, accumulated over this rank's
        micro-batches of them. Every share is of the whole ``start:stop`` (all ranks)."""
        rows = stop - start
        tokens = float(tb.loss_mask[start:stop].sum())
        sums: dict[str, float] = {}
        # Windowed trajectories give more rows than trajectories, so the number of micro-batches
        # varies: the last one is marked as DeepSpeed's accumulation boundary by hand. backward()
        # divides by the configured accumulation steps and the all-reduce by the world size,
        # which the factors below cancel.
        spans = self._spans(start, stop)
        for i, span in enumerate(spans):
            a, b = span or (start, start + 1)
            self.ds_engine.set_gradient_accumulation_boundary(i == len(spans) - 1)
            mb = tb.rows(a, b).to(self.device)
            mb_old = None if old is None else old[a:b, :mb.loss_mask.size(1)]
            loss, m = self._micro_step(mb, _rows_on(task_ids, a, b, self.device),
                                       _rows_on(log_r, a, b, self.device), mb_old)
            share = micro_share(self.cfg.loss, mb, rows, tokens) if span is not None else 0.0
            self.ds_engine.backward(loss * share * self.micro_batches * self.world)
            for k, v in (m.items() if span is not None else ()):
                sums[k] = _accumulate(k, sums.get(k), v, share)
        self.ds_engine.step()
        if self.log_z_opt is not None:
            self._average_log_z_grads()
            self.log_z_opt.step()
            self.log_z_opt.zero_grad()
        sums = self._merge_ranks(sums)
        grad_norm = self.ds_engine.get_global_grad_norm()
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return sums

    def _average_log_z_grads(self) -> None:
        """log Z lives outside DeepSpeed: average its gradients over the ranks here."""
        if self.world == 1:
            return
        for p in self.log_z.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad /= self.world

    def _merge_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """One optimizer step's metrics over every rank's micro-batches."""
        if self.world == 1:
            return sums
        every: list[dict[str, float]] = [{} for _ in range(self.world)]
        torch.distributed.all_gather_object(every, sums, group=self.control)
        merged: dict[str, float] = {}
        for part in every:
            for k, v in part.items():
                merged[k] = _accumulate(k, merged.get(k), v, 1.0)
        return merged

    def _tb_rows(self, trajs: list[Trajectory], tb: TokenBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per row, for trajectory balance: its task's code in the log Z table and log R of
        its trajectory's outcome reward; (None, None) for other losses."""
        if self.cfg.loss.type != "trajectory_balance" or tb.row_traj is None:
            return None, None
        rows = [trajs[i] for i in tb.row_traj.tolist()]
        codes = torch.tensor([self._task_code(t.task_id) for t in rows], dtype=torch.long)
        outcomes = torch.tensor([math.nan if t.outcome is None else t.outcome for t in rows],
                                dtype=torch.float64)
        return codes, log_rewards(outcomes, self.cfg.loss.log_reward_floor)

    def _task_code(self, task_id: str) -> int:
        code = self.task_codes.setdefault(task_id, len(self.task_codes))
        if code >= self.cfg.loss.max_tasks:
            raise ValueError(
                f"learner.loss.max_tasks is {self.cfg.loss.max_tasks}, but this run has trained "
                f"more distinct tasks ({task_id!r} is number {code + 1}); raise it"
            )
        return code

    def _token_logprobs(self, mb: TokenBatch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``[B, L-1]`` log-prob of each next token, ``[B, L-1]`` entropy there or None unless
        asked) under the policy being trained, at the rollout temperature."""
        return self._logprobs(self.ds_engine, mb, entropy)

    def _logprobs(self, model: Any, mb: TokenBatch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The system prompt and tool list every row opens with run once (rollout.shared_prefix),
        # except under ZeRO 3: there every forward gathers parameters collectively, so each
        # rank must run as many forwards as the others, and a share without a common prefix
        # (one row, a zero-weight step) runs one, not two.
        ids, mask = mb.input_ids, mb.attention_mask
        shared = shared_length(ids, mask) if self.cfg.zero_stage < 3 and not self.cfg.gradient_checkpointing else 0
        return next_token_logprobs(model, ids, mask, shared, self.temperature, entropy)

    def _micro_step(self, mb: TokenBatch, task_ids: torch.Tensor | None = None,
                    log_r: torch.Tensor | None = None, old: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics of one micro-batch; ``old`` None means on-policy (old = current)."""
        logp, entropy = self._token_logprobs(mb, self.cfg.loss.type == "ppo" and self.cfg.loss.entropy_coef > 0)
        ref = self._ref_logprobs(mb)
        inputs = LossInputs(
            logprobs=logp, old_logprobs=logp.detach() if old is None else old,
            behaviour_logprobs=mb.behaviour,
            advantages=mb.advantages, mask=mb.loss_mask, turn_ids=mb.turn_ids,
            clip_low=mb.clip_low, clip_high=mb.clip_high, ref_logprobs=ref, entropy=entropy,
            task_ids=task_ids, log_rewards=log_r,
        )
        return policy_loss(inputs, self.cfg.loss, self.log_z)

    def _ref_logprobs(self, mb: TokenBatch) -> torch.Tensor | None:
        """Log-probs under the reference policy (``loss.kl_coef`` > 0): the starting policy,
        which under LoRA is the same model with its adapters disabled (no second copy)."""
        if not self.kl_to_ref:
            return None
        with torch.no_grad():
            if self.cfg.lora is None:
                return self._logprobs(self.ref, mb)[0]
            with self.ds_engine.module.disable_adapter():
                return self._logprobs(self.ds_engine.module, mb)[0]

    # -- checkpoints (learner.checkpoints) -------------------------------------------------
    def save_checkpoint(self) -> str:
        """HF weights + tokenizer under checkpoints/step_N, optimizer state under ds_checkpoint
        (every rank writes its own shards there; rank 0 the rest and the commit)."""
        tag = checkpoint_tag(self.step)
        log_z = None if self.log_z is None else {
            "table": self.log_z.state_dict(), "opt": self.log_z_opt.state_dict(), "task_codes": self.task_codes}
        path = save_local(self.ds_engine, self.tokenizer, self.run_dir, tag, self.rank, log_z,
                          None if self.cfg.lora is None else (self.base, self.cfg.lora))
        if self.store is not None:
            upload_checkpoint(self.store, self.run_dir, tag, self.rank)
            if self.world > 1:
                torch.distributed.barrier(group=self.control)  # every shard stored before state.json
        if self.rank > 0:
            return str(path)
        write_state(self.run_dir, self.store, {
            "step": self.step, "version": self.version, "hf_path": str(path), "ds_tag": tag,
            **self.advantages.saved()})
        self.ports.commit(self.version)  # only now is this version's update durable
        return f"{self.store.url}/checkpoints/{tag}" if self.store is not None else str(path)

    def _log_trained(self, claim: Claim) -> None:
        log_trained(self.trained_log, self.step, self.version, claim)

    def interrupt(self) -> None:
        """Make a ``train_step`` waiting for a batch give up now (it raises InterruptedError),
        so the checkpoint queued behind it runs. Called on the actor's ``control`` concurrency
        group, which is not blocked by the step."""
        self._interrupted.set()

    def get_resumed_from(self) -> tuple[int, int]:
        return self.resumed_from

    def get_version(self) -> int:
        return self.version

    def get_step(self) -> int:
        return self.step


def checkpoint_layers(model: Any) -> None:
    """Hugging Face's gradient checkpointing of every decoder layer, non-reentrant (it needs no
    input that requires grad, so a LoRA model's frozen embeddings are fine)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def _rows_on(values: torch.Tensor | None, start: int, stop: int, device: torch.device) -> torch.Tensor | None:
    return None if values is None else values[start:stop].to(device)


def _accumulate(key: str, prev: float | None, value: float, share: float) -> float:
    """Fold one micro-batch's metric into its optimizer step's: extremes (``*_min``,
    ``*_max``) by min/max, everything else as a share-weighted sum (a mean over the step)."""
    if prev is None:
        return value if key.endswith(("_min", "_max")) else value * share
    if key.endswith("_min"):
        return min(prev, value)
    if key.endswith("_max"):
        return max(prev, value)
    return prev + value * share


def _combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """``loss/*`` metrics of a batch from its optimizer steps: means over the steps, and the
    extremes of ``*_min``/``*_max``."""
    out: dict[str, float] = {}
    for key in updates[0]:
        values = [u[key] for u in updates]
        if key.endswith("_min"):
            out[f"loss/{key}"] = min(values)
        elif key.endswith("_max"):
            out[f"loss/{key}"] = max(values)
        else:
            out[f"loss/{key}"] = float(np.mean(values))
    return out
