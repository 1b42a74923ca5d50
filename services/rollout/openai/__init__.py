"""OpenAI-compatible HTTP endpoint inside the rollout service (FastAPI, served by uvicorn).

So that an existing agent harness can be trained unchanged: point its OpenAI client at a base URL
of this server. Routes (model routes also under a per-execution prefix `/x/{execution_token}`):

- `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (routes.py);
- `POST /v1/messages` and `POST /v1/messages/count_tokens`, the Anthropic Messages API on the chat
  path (anthropic_messages.py);
- `POST /gyre/executions` (issue a per-execution endpoint), `POST /gyre/executions/{id}/end` or
  `POST /x/{token}/gyre/end` (an external harness reports the end of an execution) (routes.py);

Parts: schema.py (request models), auth.py (keys and the per-execution registry), endpoint.py
(generation through the router, one step per call), responses.py (response bodies), app.py (the
FastAPI app, its error map (every error, an unknown route included, in the API's own shape:
Anthropic's on `/v1/messages*`, OpenAI's elsewhere), the uvicorn server).
"""

from .app import create_app, serve
from .auth import Caller, ExecutionRegistry, endpoint_keys, issue_execution_endpoint
from .endpoint import OpenAIEndpoint

__all__ = [
    "Caller",
    "ExecutionRegistry",
    "OpenAIEndpoint",
    "create_app",
    "endpoint_keys",
    "issue_execution_endpoint",
    "serve",
]
