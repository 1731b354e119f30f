"""An OpenAI-compatible HTTP server over any checkpoint: ``tether serve MODEL``.

``/v1/completions`` (a prompt string or a list of them), ``/v1/chat/completions`` (a message list, rendered
with the tokenizer's chat template), ``/v1/models`` and ``/v1/models/{id}``, on FastAPI + uvicorn, generating
with a rollout engine (:class:`tether.rollout.HFEngine` by default, or any ``GenerationEngine``). Sampling
options: ``n``, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (an extension, as in vLLM), ``max_tokens``,
``stop`` (a string or a list), ``seed``; ``stream`` and ``stream_options.include_usage``; ``logprobs`` (and
chat ``top_logprobs``).

Safety defaults: bound to 127.0.0.1, and another host only with an API key (or ``--insecure-no-api-key``);
request bodies over ``max_request_bytes`` get 413 before they are parsed; a request over its budget
(:class:`ServeBudget`: n, max_tokens, prompts x n, prompts x n x max_tokens) gets 400 before anything is
generated; generation runs in bounded chunks that take turns across requests; with an API key (read from an
environment variable, never a command-line argument) every ``/v1`` route needs ``Authorization: Bearer KEY``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

How it departs from OpenAI's API: no tools, ``response_format`` or penalties (400, not ignored); streaming is
per choice (each choice's whole text in one chunk once its generation chunk is done), not per token; a stop
string is removed from the returned text, as OpenAI does, though the engine stops on it after the token that
completed it.

Modules: ``app`` (the routes), ``scheduler`` (budget and fair turns), ``openai_format`` (response shapes),
``limits`` (the body-size guard), ``process`` (sockets, a server in a thread or a child process, ``serve``).
"""

from tether.core.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "create_app": "tether.serve.app",
    "ServeState": "tether.serve.app",
    "ServeBudget": "tether.serve.scheduler",
    "FairScheduler": "tether.serve.scheduler",
    "BodyLimit": "tether.serve.limits",
    "BackgroundServer": "tether.serve.process",
    "ServerProcess": "tether.serve.process",
    "bind_socket": "tether.serve.process",
    "serve": "tether.serve.process",
    "DEFAULT_HOST": "tether.serve.process",
    "LISTENING": "tether.serve.process",
})
