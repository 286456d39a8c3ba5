"""`resource()`: one Starlette route per path, dispatching on the HTTP method.

Starlette answers a wrong method with the `Allow` list of the first route whose path matched; with one
route per path serving several methods, that list is every method the resource supports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

Endpoint = Callable[[Request], Awaitable[Response]]


def resource(path: str, name: str, handlers: Mapping[str, Endpoint]) -> Route:
    """A route at `path` calling ``handlers[method]`` (HEAD is served by the GET handler)."""
    table = dict(handlers)

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" and "HEAD" not in table else request.method
        return await table[method](request)

    return Route(path, dispatch, methods=list(table), name=name)
