"""/v1/models: the models a request may name (the configured one and MODELS, or every model
of PROVIDERS_FILE), each with the name of the provider serving it."""

from __future__ import annotations

from typing import Any

from litestar import get
from litestar.params import FromPath

from service.api.deps import Caller
from service.api.routes import Resource, openai_route
from service.core.errors import ModelNotFound, UnknownModel

CREATED = 1_700_000_000  # OpenAI's shape needs a creation time; turnstore does not know one


def model_object(name: str, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": CREATED, "owned_by": owner}


class OpenAIModels(Resource):
    path = "/v1/models"

    @get("/", **openai_route("The models a request may name."))
    async def listing(self, api: Caller) -> dict[str, Any]:
        served = api.cases.responses
        data = [model_object(model, served.served_by(model)) for model in served.models]
        return {"object": "list", "data": data}

    @get("/{model:str}", **openai_route("One model a request may name.", UnknownModel))
    async def retrieve(self, model: FromPath[str], api: Caller) -> dict[str, Any]:
        try:
            api.cases.responses.check_model(model)
        except ModelNotFound:
            raise UnknownModel() from None
        return model_object(model, api.cases.responses.served_by(model))
