"""transformers' OpenAI-compatible server (`transformers serve`, `transformers.cli.serve.Serve`), as `hf-kvcache
serve` uses it. It has no extension point for the page format, the KV memory or admission, so `hf-kvcache serve`
relies on:

1. `Serve.__init__(force_model, ..., continuous_batching, cb_num_blocks, ..., non_blocking)` wires the model
   manager (which preloads `force_model`), the generation state, the endpoint handlers and a `uvicorn.Server`
   (`serve.server`, whose `config.app` is the FastAPI app) and, with `non_blocking=True`, ends by calling
   `self.start_server()`: `build_serve` gives the instance a `start_server` that does nothing, so the server is
   wired but not started while we add our parts, then `run` starts it.
2. `serve._generation_state._cb_config` is the ContinuousBatchingConfig (built from the `--cb-*` flags) that
   `CBGenerateManager.init_cb` passes to `model.init_continuous_batching(generation_config=...,
   continuous_batching_config=...)`: the fields of hf_kvcache.paged.spec set on it switch on quantized pages.
3. `serve._model_manager.loaded_models` maps each loaded model to an object with `.model`.
4. The routes call `serve._chat_handler` / `_completion_handler` / `_response_handler`'s `handle_request(body,
   request_id)` by attribute, so a wrapper set on the instance sees every request body first.
5. `CBGenerateManager` calls the manager's `add_request(input_ids, request_id=..., max_new_tokens=..., ...)` before
   its response starts (an exception there becomes the HTTP response), and a streaming client that disconnects
   cancels its request (`streamer.cancel()` -> `cancel_request`).
6. `serve._generation_state._cb_manager._cb` is the running ContinuousBatchingManager (None before the first
   request).
7. A non-streaming request registers its result handler (`register_result_handler`: an entry of
   `output_router.result_handlers`, under `output_router._lock`) before `add_request`, and only a finished result
   removes it: a request our admission refuses never finishes, so `forget_result_handler` removes its entry
   (otherwise one per refused request stays for the server's lifetime).
"""

from __future__ import annotations

import enum
import inspect
import typing
from dataclasses import dataclass

from .contracts import contract, parameters, require, source

USED_BY = "hf-kvcache serve"
SERVE = "transformers.cli.serve.Serve (wiring, generation state, handlers)"
ADMISSION = "transformers.cli.serving.utils.CBGenerateManager (add_request, cancel on disconnect)"
RESULT_HANDLERS = "transformers ContinuousBatchingManager.register_result_handler (output_router.result_handlers)"
#: the Serve parameters hf-kvcache serve sets itself (the rest pass through as flags)
OWN_PARAMETERS = ("force_model", "continuous_batching", "cb_num_blocks", "non_blocking")
#: the handler attributes of Serve, by endpoint (/v1/chat/completions, /v1/completions, /v1/responses)
HANDLERS = {"chat_completion": "_chat_handler", "completion": "_completion_handler", "response": "_response_handler"}


def _serve_class():
    from transformers.cli.serve import Serve

    return Serve


@contract(
    SERVE,
    "Serve(force_model, ..., continuous_batching, cb_num_blocks, ..., non_blocking) wires "
    "_model_manager, _generation_state (GenerationState(cb_config=...)), the handlers and self.server "
    "(uvicorn), and calls self.start_server() when non_blocking",
    USED_BY,
)
def _check_serve() -> str | None:
    serve = _serve_class()
    names = parameters(serve.__init__)
    missing = [n for n in OWN_PARAMETERS if n not in names]
    if missing:
        return f"Serve.__init__ no longer takes {missing}"
    text = source(serve.__init__)
    for needle in (
        "self.start_server()",
        "self._generation_state = GenerationState(",
        "cb_config=cb_config",
        "self._model_manager = ModelManager(",
        "self.server = uvicorn.Server(",
        *HANDLERS.values(),
    ):
        if needle not in text:
            return f"Serve.__init__ no longer contains `{needle}`"
    from transformers.cli.serving import model_manager, utils

    if "self.loaded_models" not in source(model_manager.ModelManager.__init__):
        return "ModelManager no longer keeps loaded_models"
    if "self._cb_config = cb_config" not in source(utils.GenerationState.__init__):
        return "GenerationState no longer keeps the continuous-batching config as _cb_config"
    if "continuous_batching_config=self._cb_config" not in source(utils.CBGenerateManager.init_cb):
        return "CBGenerateManager.init_cb no longer passes _cb_config to init_continuous_batching"
    return None


@contract(
    ADMISSION,
    "CBGenerateManager calls cb.add_request(input_ids, request_id=..., max_new_tokens=...) before "
    "the response starts; a disconnected stream calls cancel_request",
    USED_BY,
)
def _check_admission() -> str | None:
    from transformers.cli.serving import utils

    manager = utils.CBGenerateManager
    for method in ("generate_streaming", "generate_non_streaming"):
        text = source(getattr(manager, method, None))
        if "cb.add_request(" not in text or "max_new_tokens=" not in text:
            return f"CBGenerateManager.{method} no longer calls cb.add_request(..., max_new_tokens=...)"
    if "cancel_request(" not in source(utils.CBStreamer.cancel):
        return "CBStreamer.cancel no longer cancels the request"
    if "_cb" not in source(manager.__init__):
        return "CBGenerateManager no longer keeps its ContinuousBatchingManager as _cb"
    return None


@contract(
    RESULT_HANDLERS,
    "register_result_handler stores the callback in "
    "self.output_router.result_handlers[request_id] under self.output_router._lock, and only a finished result "
    "removes it",
    USED_BY,
)
def _check_result_handlers() -> str | None:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    text = source(getattr(ContinuousBatchingManager, "register_result_handler", None))
    for needle in ("self.output_router.result_handlers[request_id]", "self.output_router._lock"):
        if needle not in text:
            return f"ContinuousBatchingManager.register_result_handler no longer contains `{needle}`"
    return None


def forget_result_handler(manager, request_id) -> None:
    """Remove the result handler a request registered before `add_request` refused it (7. above); nothing when it
    registered none. `manager`: a ContinuousBatchingManager."""
    router = getattr(manager, "output_router", None)
    if router is None or request_id is None:
        return
    with router._lock:
        router.result_handlers.pop(request_id, None)


@dataclass(frozen=True)
class ServeOption:
    """One `transformers serve` option, read from Serve's typer annotations."""

    name: str  # the parameter, e.g. "cb_max_batch_tokens" (flag --cb-max-batch-tokens)
    type: type  # bool, int, float or str
    default: object
    help: str
    choices: tuple | None = None  # an Enum's values


def serve_options() -> list[ServeOption]:
    """Every `transformers serve` option, less the ones hf-kvcache serve sets itself (OWN_PARAMETERS)."""
    require(SERVE)
    options = []
    for param in inspect.signature(_serve_class().__init__).parameters.values():
        if param.name == "self" or param.name in OWN_PARAMETERS:
            continue
        annotated = typing.get_args(param.annotation)
        kind = annotated[0] if annotated else param.annotation
        info = annotated[1] if len(annotated) > 1 else None
        kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)  # X | None -> X
        choices = (
            tuple(member.value for member in kind) if isinstance(kind, type) and issubclass(kind, enum.Enum) else None
        )
        default = param.default.value if isinstance(param.default, enum.Enum) else param.default
        options.append(
            ServeOption(param.name, str if choices else kind, default, getattr(info, "help", None) or "", choices)
        )
    return options


def build_serve(force_model: str, cb_num_blocks: int, **options):
    """transformers' server for `force_model` with continuous batching, wired but not started (see `run`)."""
    require(SERVE, ADMISSION, RESULT_HANDLERS)
    serve_class = _serve_class()
    serve = serve_class.__new__(serve_class)
    serve.start_server = lambda: None  # Serve.__init__ ends with start_server() when non_blocking: not yet
    serve_class.__init__(
        serve,
        force_model=force_model,
        continuous_batching=True,
        cb_num_blocks=cb_num_blocks,
        non_blocking=True,
        **options,
    )
    del serve.start_server
    return serve


def continuous_batching_config(serve):
    """The ContinuousBatchingConfig every continuous-batching manager of `serve` is built with."""
    config = serve._generation_state._cb_config
    if config is None:
        raise RuntimeError("transformers serve built no continuous-batching config (cb_num_blocks was not set)")
    return config


def served_model(serve):
    """The model `serve` preloaded (force_model)."""
    models = [timed.model for timed in serve._model_manager.loaded_models.values()]
    if len(models) != 1:
        raise RuntimeError(f"expected the one preloaded model, transformers serve holds {len(models)}")
    return models[0]


def app(serve):
    """The FastAPI app of `serve`."""
    return serve.server.config.app


def wrap_handlers(serve, wrapper) -> None:
    """Route every request body through `wrapper(handle_request, endpoint)`; endpoint is a key of HANDLERS."""
    for endpoint, name in HANDLERS.items():
        handler = getattr(serve, name)
        handler.handle_request = wrapper(handler.handle_request, endpoint)


def running_manager(serve):
    """The ContinuousBatchingManager serving requests, None before the first request built it."""
    generate_manager = serve._generation_state._cb_manager
    return None if generate_manager is None else generate_manager._cb


def run(serve) -> None:
    """Serve until interrupted (uvicorn's own signal handling), then stop the generation thread."""
    try:
        serve.server.run()
    finally:
        serve._generation_state.shutdown()


__all__ = [
    "ADMISSION",
    "RESULT_HANDLERS",
    "SERVE",
    "app",
    "build_serve",
    "continuous_batching_config",
    "forget_result_handler",
    "run",
    "running_manager",
    "ServeOption",
    "serve_options",
    "served_model",
    "wrap_handlers",
]
