"""GET /dashboard: live charts of a run, drawn in the browser from /v1/runs/{id}/metrics.

No CDN and no build step: one HTML page, one stylesheet and one script from
``services/static/``. A browser without a session gets the login page (status 401); logging
in posts the token once to ``/v1/session`` with an Authorization header and receives an
HttpOnly, SameSite=Strict cookie that authenticates GET requests only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, HTMLResponse

from services.auth import SESSION_COOKIE, authenticate
from services.schemas import BAD_QUERY, Problem

if TYPE_CHECKING:
    from services.api import ServiceState

STATIC = Path(__file__).parent / "static"
_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def add_dashboard(app: FastAPI, state: "ServiceState") -> None:
    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard(request: Request) -> Response:
        try:
            authenticate(request)
        except HTTPException:
            return HTMLResponse((STATIC / "login.html").read_text(), status_code=401)
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    def static(name: str, request: Request) -> Response:
        authenticate(request)
        if name not in _FILES:  # a fixed list: no path ever reaches the filesystem unchecked
            raise HTTPException(404, "not found")
        return FileResponse(STATIC / name, media_type=_FILES[name])

    unauthorized = {401: {"model": Problem, "description": "Missing or invalid bearer token"}, **BAD_QUERY}

    @app.post("/v1/session", status_code=204, operation_id="login", tags=["session"], responses=unauthorized)
    def login(request: Request) -> Response:
        """Exchange a bearer token (Authorization header) for a dashboard session cookie."""
        if not request.headers.get("authorization"):
            raise HTTPException(401, "send the token as Authorization: Bearer <token>",
                                headers={"WWW-Authenticate": "Bearer"})
        principal = authenticate(request)
        response = Response(status_code=204)
        response.set_cookie(SESSION_COOKIE, state.sessions.create(principal), httponly=True, samesite="strict",
                            max_age=int(state.cfg.auth.session_ttl_s), path="/",
                            secure=request.url.scheme == "https")
        return response

    @app.delete("/v1/session", status_code=204, operation_id="logout", tags=["session"], responses=unauthorized)
    def logout(request: Request) -> Response:
        """End the dashboard session (the cookie itself, or a bearer token, authenticates this)."""
        sid = request.cookies.get(SESSION_COOKIE)
        if sid and state.sessions.get(sid) is not None:
            state.sessions.revoke(sid)
        else:
            authenticate(request)
        response = Response(status_code=204)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response
