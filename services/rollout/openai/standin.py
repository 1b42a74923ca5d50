"""The vLLM stand-in routes (admin only): `GET /is_sleeping`, `POST /sleep`, `POST /wake_up`,
`POST /collective_rpc` (method `reload_weights`), the control protocol `VLLMEngine` speaks, so the
vLLM engine can be exercised against this endpoint.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gyre.errors import InvalidArgument
from gyre.v1 import common_pb2

from .routes import CallerDep, EndpointDep
from .schema import CollectiveRpcRequest

standin_routes = APIRouter()


@standin_routes.get("/is_sleeping")
async def is_sleeping(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    return {"is_sleeping": endpoint.sleeping}


@standin_routes.post("/sleep")
async def sleep(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    endpoint.sleeping = True
    return {}


@standin_routes.post("/wake_up")
async def wake_up(endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    endpoint.require_admin(caller)
    endpoint.sleeping = False
    return {}


@standin_routes.post("/collective_rpc")
async def collective_rpc(request: Request, endpoint: EndpointDep, caller: CallerDep) -> dict[str, Any]:
    """Admin: `reload_weights` — the same validation as a weights event (store, sha256, version)."""
    endpoint.require_admin(caller)
    body = await endpoint.parse(request, CollectiveRpcRequest)
    if endpoint.weights_loader is None:
        raise InvalidArgument("this server has no weight loader")
    kw = body.kwargs
    weights = common_pb2.WeightVersion(version=kw.version, uri=kw.uri, sha256=kw.sha256)
    await endpoint.weights_loader(weights)
    return {"results": [weights.version]}
