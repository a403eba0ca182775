"""The HTTP front's bearer token: the OpenAI API key a client sends must be this server's --auth-token.

Why the gRPC servers' semantics (kvtransfer/rpc/security.py): one secret, compared in constant time, missing
and wrong told apart in the message, and the health probe left open so an orchestrator can check readiness
without holding the secret. Why ASGI middleware rather than a FastAPI dependency: a request without the token
is refused before its body is read or parsed, so an unauthenticated client learns nothing about what the body
would have been told (malformed JSON, unknown model).
"""

from __future__ import annotations

import hmac

from api_server.errors import ApiError

OPEN_PATHS = ("/health",)


class RequireToken:
    def __init__(self, app, token: str):
        self.app, self._token = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        scheme, _, value = (got or b"").partition(b" ")
        if got is not None and scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self._token):
            return await self.app(scope, receive, send)
        why = ("missing 'Authorization: Bearer <token>' header: this server requires its shared token (the OpenAI "
               "client's api_key, or OPENAI_API_KEY)") if got is None else \
            "the bearer token does not match this server's --auth-token; check both sides use the same secret"
        await ApiError(401, why, code="invalid_api_key").response()(scope, receive, send)
