"""A Python client of the run service, driven by its OpenAPI spec.

The client reads ``/openapi.json`` once and calls operations by their ``operationId``
(``submitRun``, ``getRun`` ...), so paths and methods come from the server it talks to and an
operation the server lacks fails with a clear message instead of a 404 on a guessed path.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import httpx

DEFAULT_URL = "http://127.0.0.1:8321"


class ServiceError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class ServiceClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 30.0) -> None:
        token = token or os.environ.get("TURNRL_TOKEN")
        if not token:
            raise ValueError("no API token: set TURNRL_TOKEN (or pass --token-file / token=)")
        self.url = (url or os.environ.get("TURNRL_URL") or DEFAULT_URL).rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout_s)
        self._ops: dict[str, tuple[str, str]] | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the spec ---------------------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        return self._json(self._http.get("/openapi.json"))

    def operations(self) -> dict[str, tuple[str, str]]:
        """operationId -> (HTTP method, path template), from the server's spec."""
        if self._ops is None:
            self._ops = {op["operationId"]: (method.upper(), path)
                         for path, item in self.spec()["paths"].items()
                         for method, op in item.items() if isinstance(op, dict) and "operationId" in op}
        return self._ops

    def _request(self, operation: str, path_params: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        try:
            method, template = self.operations()[operation]
        except KeyError:
            raise ServiceError(0, f"the service at {self.url} has no operation {operation!r}") from None
        return self._http.request(method, template.format(**(path_params or {})), **kwargs)

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise ServiceError(response.status_code, detail)
        return response.json() if response.content else None

    # -- operations -------------------------------------------------------------------------
    def submit(self, config: dict[str, Any]) -> dict[str, Any]:
        """Start a run from a RunConfig (as a dict); returns its summary (``id``, ``status``)."""
        return self._json(self._request("submitRun", json=config))

    def pools(self) -> list[dict[str, Any]]:
        """The engine pools a run may name in ``rollout.pool`` (docs/tenants.md)."""
        return self._json(self._request("listPools"))["pools"]

    def list(self, status: str | None = None) -> list[dict[str, Any]]:
        params = {"status": status} if status else {}
        return self._json(self._request("listRuns", params=params))["runs"]

    def status(self, run_id: str) -> dict[str, Any]:
        return self._json(self._request("getRun", {"run_id": run_id}))

    def metrics(self, run_id: str, cursor: int = 0, keys: list[str] | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"cursor": cursor}
        if keys:
            params["keys"] = ",".join(keys)
        return self._json(self._request("getRunMetrics", {"run_id": run_id}, params=params))

    def logs(self, run_id: str, tail: int | None = None) -> str:
        params = {"tail": tail} if tail is not None else {}
        response = self._request("getRunLogs", {"run_id": run_id}, params=params)
        if response.status_code >= 400:
            self._json(response)
        return response.text

    def follow_logs(self, run_id: str, tail: int | None = None) -> Iterator[str]:
        """The last ``tail`` lines, then new output until the run ends."""
        method, template = self.operations()["getRunLogs"]
        params: dict[str, Any] = {"follow": "true", **({"tail": tail} if tail is not None else {})}
        with self._http.stream(method, template.format(run_id=run_id), params=params, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            yield from response.iter_text()

    def stop(self, run_id: str) -> dict[str, Any]:
        return self._json(self._request("stopRun", {"run_id": run_id}))

    def delete(self, run_id: str, keep_files: bool = False) -> None:
        self._json(self._request("deleteRun", {"run_id": run_id}, params={"keep_files": str(keep_files).lower()}))
