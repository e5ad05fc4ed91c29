"""`GET /v1/models` and `GET /v1/models/{id}`: the served model's card."""

from __future__ import annotations

from aiohttp import web

from . import responses as R


def model_card(state) -> dict:
    """OpenAI's model object, plus the context this server serves (`max_model_len`) and, when
    a cap or --max-model-len made that shorter or longer, the checkpoint's own length."""
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "pocketllm"}
    client = state.client
    if client is not None:
        info = client.info
        card["max_model_len"] = info.max_model_len
        if info.context_length and info.context_length != info.max_model_len:
            card["checkpoint_context_length"] = info.context_length
    return card


def list_models(state) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(state)]})


def retrieve_model(state, model_id: str) -> web.Response:
    if model_id != state.model_name:
        return R.error_response(404, f"the model {model_id!r} does not exist: this server "
                                f"serves {state.model_name!r}", param="model",
                                code="model_not_found")
    return web.json_response(model_card(state))
