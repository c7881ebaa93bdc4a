"""`POST /v1/realtime/client_secrets`: an app's backend (with the server token) mints a short-lived
`ek_` key for a browser or a phone app, in OpenAI's GA shape (realtime/client_secrets.py says how a key
is made; realtime/auth.py where it is accepted). The key's session config is checked now, with the
rules session.update applies, so a key never opens a session that starts with an error."""

from __future__ import annotations

import json
from http import HTTPStatus

from realtime import client_json
from realtime.client_secrets import SecretRequestError, session_validator
from realtime.http import HttpReply, HttpRequest, HttpRoute, json_error
from realtime.protocol import SessionSettings
from realtime.transports.context import TransportContext

NAME = "client_secrets"
PATH = "/v1/realtime/client_secrets"


def register(ctx: TransportContext) -> None:
    cfg = ctx.config
    validate = session_validator(SessionSettings.of(cfg.session, ctx.voices), ctx.admission.engine.supports_text,
                                 turn_detection=cfg.vad.params(), text_limits=cfg.limits.text)

    async def mint(req: HttpRequest) -> HttpReply:
        raw = await req.read()
        try:
            body = client_json.loads(raw) if raw.strip() else None
        except (UnicodeDecodeError, ValueError) as e:
            return json_error(HTTPStatus.BAD_REQUEST, "invalid_json", f"the body must be a JSON object: {e}")
        try:
            minted = ctx.auth.secrets.mint(body, validate)
        except SecretRequestError as e:
            return json_error(HTTPStatus.BAD_REQUEST, e.code, e.message, param=e.param)
        return HttpReply(HTTPStatus.OK, json.dumps(minted), "application/json")

    ctx.routes.http[PATH] = HttpRoute(mint, cors=True)
