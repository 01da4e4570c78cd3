"""Serves the dashboard page and its static files. The page itself is public HTML: every data
call it makes carries the admin key the operator typed in (kept in sessionStorage)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter(prefix="/admin", tags=["admin: dashboard"])


@router.get("/", include_in_schema=False)
def dashboard() -> FileResponse:
    # no-cache: an upgraded service serves its own page, not the browser's copy
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    """Adds the page route and mounts the static files (uPlot, the page's script and style)."""
    app.include_router(router)
    app.mount("/admin/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
