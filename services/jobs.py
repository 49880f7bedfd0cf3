"""Runs as Ray jobs, through Ray's Job Submission API (so ``ray job list/logs/stop`` see them).

A run's submission id is its run id. The entrypoint is ``python -m services.job
<run_dir>/run.yaml`` (``turnrl train`` with the run's secrets, ``services.secrets``) started in
the configured working directory; stopping sends the job the configured signal (Ray's
``RAY_JOB_STOP_SIGNAL``) and gives it ``stop_grace_s`` to write its final checkpoint before
Ray kills it.
"""

from __future__ import annotations

import logging
import shlex
import sys
import threading
from pathlib import Path
from typing import Any, AsyncIterator

from services.config import JobsConfig

log = logging.getLogger(__name__)

# Ray job status -> run status (the service adds "stopping" and "lost").
RAY_STATUS = {"PENDING": "pending", "RUNNING": "running", "SUCCEEDED": "succeeded",
              "STOPPED": "stopped", "FAILED": "failed"}


class JobNotFound(LookupError):
    """Ray has no job with this submission id (deleted, or the cluster was replaced)."""


class RayUnavailable(RuntimeError):
    """The job server did not answer."""


def _not_found(exc: Exception) -> bool:
    # the SDK raises RuntimeError("Request failed with status code 404: Job ... does not exist.")
    return "status code 404" in str(exc) or "does not exist" in str(exc)


def _unreachable(exc: Exception) -> bool:
    return "ConnectionError" in type(exc).__name__ or "Connection refused" in str(exc) or "Timeout" in type(exc).__name__


class RayJobs:
    def __init__(self, address: str, cfg: JobsConfig) -> None:
        self.address = address.rstrip("/")
        self.cfg = cfg
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """Created on first use: the constructor itself calls the job server."""
        with self._lock:
            if self._client is None:
                from ray.job_submission import JobSubmissionClient

                try:
                    self._client = JobSubmissionClient(self.address)
                except Exception as exc:
                    raise RayUnavailable(f"Ray job server at {self.address} is unreachable: {exc}") from None
            return self._client

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.client, method)(*args)
        except RayUnavailable:
            raise
        except Exception as exc:
            if _unreachable(exc):
                with self._lock:
                    self._client = None  # reconnect next time (the head may have restarted)
                raise RayUnavailable(f"Ray job server at {self.address}: {exc}") from None
            if _not_found(exc):
                raise JobNotFound(args[0] if args else "") from None
            raise RayUnavailable(f"Ray job server at {self.address} failed: {exc}") from None

    def entrypoint(self, config_path: Path, module: str = "services.job") -> str:
        python = self.cfg.python or sys.executable
        workdir = self.cfg.workdir()
        # services.job is `turnrl train` with the run's secrets read from its 0600 file
        train = f"{shlex.quote(python)} -m {module} {shlex.quote(str(config_path))}"
        if self.cfg.stop_signal == "SIGINT":
            # Ray starts jobs with SIGINT ignored; GNU env restores the default so that Python
            # turns the stop signal into KeyboardInterrupt (the driver's checkpointing path).
            train = f"env --default-signal=INT {train}"
        return f"cd {shlex.quote(str(workdir))} && exec {train}"

    def env(self) -> dict[str, str]:
        return {**self.cfg.env,
                "PYTHONUNBUFFERED": "1",  # logs reach `ray job logs` and the API line by line
                # read by Ray's job supervisor for this job only
                "RAY_JOB_STOP_SIGNAL": self.cfg.stop_signal,
                "RAY_JOB_STOP_WAIT_TIME_S": str(self.cfg.stop_grace_s),
                # the driver's own ray.init(runtime_env=...) may set the same variables
                "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}

    def submit(self, run_id: str, config_path: Path, metadata: dict[str, str], module: str = "services.job") -> None:
        """Start ``python -m <module> <config_path>`` as the job ``run_id`` (a run, or with
        ``module="cluster.pool"`` an engine pool)."""
        try:
            self.client.submit_job(entrypoint=self.entrypoint(config_path, module), submission_id=run_id,
                                   runtime_env={"env_vars": self.env()}, metadata=metadata)
        except RayUnavailable:
            raise
        except Exception as exc:
            raise RayUnavailable(f"could not submit the run to Ray at {self.address}: {exc}") from None

    def info(self, run_id: str) -> tuple[str, str | None]:
        """(run status from Ray's job status, Ray's message)."""
        details = self._call("get_job_info", run_id)
        status = getattr(details.status, "value", str(details.status))
        return RAY_STATUS.get(status, "running"), details.message

    def logs(self, run_id: str) -> str:
        return self._call("get_job_logs", run_id)

    async def follow(self, run_id: str) -> AsyncIterator[str]:
        """The job's whole log from the start, then new output until the job ends."""
        async for chunk in self.client.tail_job_logs(run_id):
            yield chunk

    def stop(self, run_id: str) -> bool:
        return bool(self._call("stop_job", run_id))

    def delete(self, run_id: str) -> bool:
        return bool(self._call("delete_job", run_id))

    def with_metadata(self, key: str) -> list[tuple[str, str, dict[str, str]]]:
        """(submission id, run status, metadata) of every job whose metadata has ``key``."""
        jobs = self._call("list_jobs")
        return [(j.submission_id, RAY_STATUS.get(getattr(j.status, "value", str(j.status)), "running"), j.metadata)
                for j in jobs if key in (j.metadata or {})]

    def up(self) -> bool:
        from services.ray_cluster import job_server_up

        return job_server_up(self.address)
