"""The FastAPI application: OpenAI's routes over one Triton model.

    GET  /v1/models, /v1/models/{id}     the served model and its LoRA adapters
    POST /v1/completions                 prompt → text
    POST /v1/chat/completions            messages → assistant message (the model's chat template)
    GET  /health/live, /health/ready     this process; Triton and the model

Each generation route checks the model name (404), turns the request into a `Plan` (400 for
what cannot be served), checks that Triton is ready (503), then runs one Triton stream per
choice. `create_app` takes ready-made parts, so tests can build the app around any of them; the
generation routes' well-formed requests skip FastAPI's machinery (fast_path.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import Response

from openai_frontend import errors
from openai_frontend.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from openai_frontend.chat import ChatRenderer
from openai_frontend.fast_path import FastPath
from openai_frontend.generation import collect, merge, run_choice
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from openai_frontend.responses import ChatStream, CompletionStream, Context, chat_completion, completion
from openai_frontend.sampling import Limits, Plan, chat_plan, completion_plan
from openai_frontend.sse import ClientGone, event_stream, until_disconnect
from openai_frontend.triton_client import TritonClient


@dataclass(frozen=True)
class ServedModel:
    """The one model this frontend serves, under `name`, and the LoRA adapters on it, each by
    its own name (`adapters`: name -> the engine's task id, vLLM's `--lora-modules`)."""

    name: str
    renderer: ChatRenderer
    limits: Limits
    created: int
    owned_by: str = "triton-inflight-llm"
    adapters: dict[str, int] = field(default_factory=dict)

    def cards(self) -> list[ModelCard]:
        base = ModelCard(id=self.name, created=self.created, owned_by=self.owned_by)
        return [base] + [ModelCard(id=name, created=self.created, owned_by=self.owned_by, root=self.name,
                                   parent=self.name) for name in self.adapters]

    def check(self, requested: str) -> int | None:
        """The LoRA task id `requested` names (None: the base model); 404 for an unknown name."""
        if requested == self.name:
            return None
        if requested in self.adapters:
            return self.adapters[requested]
        raise errors.model_not_found(requested)

    def with_adapter(self, plan: Plan, task_id: int | None) -> Plan:
        if task_id is None:
            return plan
        return replace(plan, requests=[replace(r, lora_task_id=task_id) for r in plan.requests])


def _json(model, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def create_app(client: TritonClient, served: ServedModel,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> BodyLimit:
    """The ASGI app: FastAPI's routes, the generation routes' common case served by FastPath,
    every body bounded by `max_body_bytes`."""
    app = FastAPI(title="OpenAI-compatible API for a Triton LLM ensemble", docs_url=None,
                  redoc_url=None, openapi_url=None)
    errors.install_handlers(app)
    app.state.client = client
    app.state.served = served

    async def generate(request: Request, plan: Plan, ctx: Context, stream_type, build_whole):
        await client.check_ready()
        events = merge([run_choice(client, engine_request, i, plan.stops, f"{ctx.id}-{i}", plan.echo[i],
                                   plan.echo_tokens[i] if plan.echo_tokens else (), plan.drop_output)
                        for i, engine_request in enumerate(plan.requests)])
        try:
            if plan.stream:
                return await event_stream(request, events, stream_type(ctx))
            return _json(build_whole(ctx, await until_disconnect(request, collect(events, ctx.num_choices))))
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/models")
    async def list_models():
        return _json(ModelList(data=served.cards()))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        served.check(model_id)
        return _json(next(card for card in served.cards() if card.id == model_id))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        task_id = served.check(body.model)
        plan = completion_plan(body, served.limits, served.renderer.decode, served.renderer.encode_text)
        plan = served.with_adapter(plan, task_id)
        ctx = Context(f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model, plan,
                      served.renderer.token_text)
        return await generate(request, plan, ctx, CompletionStream, completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        task_id = served.check(body.model)
        plan = served.with_adapter(chat_plan(body, served.renderer, served.limits), task_id)
        ctx = Context(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model, plan,
                      served.renderer.token_text)
        return await generate(request, plan, ctx, ChatStream, chat_completion)

    fast = FastPath(app, {"/v1/completions": (CompletionRequest, completions),
                          "/v1/chat/completions": (ChatCompletionRequest, chat_completions)})

    @app.get("/health/live")
    async def live():
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready():
        await client.check_ready(fresh=True)
        return {"status": "ready"}

    return BodyLimit(fast, max_body_bytes)
