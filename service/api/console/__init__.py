"""The console at /console: static files only, a client of the public /api/v1 and /v1 APIs.

Nothing here reads data: the files are public (they hold none), and every call the page
makes carries the key its user typed (kept in the tab's sessionStorage) through the same
guard as any other client. The Swagger UI of /schema/swagger is served from here too, so
the API docs render with no network: static/vendor/swagger-ui holds three files of the npm
package swagger-ui-dist 5.35.0 as published (swagger-ui-bundle.js,
swagger-ui-standalone-preset.js, swagger-ui.css) with its LICENSE, NOTICE and the licence
notes of what the bundles include.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Response, Router
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.static_files import create_static_files_router

STATIC = Path(__file__).parent / "static"
PATH = "/console"
SWAGGER = f"{PATH}/vendor/swagger-ui"

# Module files only: no inline script or style, no other origin. The sign-in form is never
# submitted by the browser (form-action 'none'), so a key cannot end up in a URL.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


async def _secure(response: Response[Any]) -> Response[Any]:
    response.headers["Content-Security-Policy"] = POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


router: Router = create_static_files_router(
    PATH, directories=[STATIC], html_mode=True, name="console", after_request=_secure
)


def swagger_plugin(path: str) -> SwaggerRenderPlugin:
    """Litestar's Swagger UI page with its scripts and styles served by turnstore."""
    return SwaggerRenderPlugin(
        path=path,
        js_url=f"{SWAGGER}/swagger-ui-bundle.js",
        css_url=f"{SWAGGER}/swagger-ui.css",
        standalone_preset_js_url=f"{SWAGGER}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' href='{PATH}/favicon.svg'>",
    )
