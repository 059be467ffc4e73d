"""The in-process OpenAI client's errors as the ``openai`` SDK raises a server's answer.

An agent written for the SDK catches ``openai.BadRequestError`` (and its siblings), reads
``status_code`` and ``message``; the in-process client (``rollout/openai_client.py``, and its
Responses API) therefore raises exactly those, with the status an HTTP server would have answered,
and the proxy (``rollout/proxy.py``) answers that status. The original exception stays the
``__cause__`` (episode retries look there for transport failures, ``episodes.is_transport_error``).
"""

from __future__ import annotations

import openai


def error_status(exc: BaseException) -> tuple[int, str] | None:
    """The HTTP status and message a server would answer for ``exc``; None: a bug, raised as is."""
    from areal_cli.errors import InferenceError
    from areal_cli.inference.client import RequestRejected
    from areal_cli.inference.server.openai_compat import HTTPError

    if isinstance(exc, RequestRejected):
        return exc.status, exc.server_message
    if isinstance(exc, HTTPError):
        return exc.status, str(exc)
    if isinstance(exc, ValueError):  # BadRequest included: the request's fault
        return 400, str(exc)
    if isinstance(exc, InferenceError):  # the servers failed (5xx, unreachable, timeouts) after retries
        return 502, f"the inference server failed: {exc}"
    return None


def sdk_error(client: openai.AsyncOpenAI, exc: BaseException, path: str) -> openai.APIStatusError | None:
    """``exc`` as the exception the SDK raises for that status (``openai.BadRequestError`` for 400, ...),
    built on a synthetic response, or None when ``exc`` is not a request or server error."""
    if isinstance(exc, openai.APIStatusError):
        return exc
    got = error_status(exc)
    if got is None:
        return None
    status, msg = got
    try:  # the SDK's HTTP library: httpx2 from openai 3, httpx before
        import httpx2 as hx
    except ImportError:
        import httpx as hx
    body = {"error": {"message": msg, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": status}}
    resp = hx.Response(status, json=body, request=hx.Request("POST", f"{client.base_url}".rstrip("/") + path))
    return client._make_status_error(msg, body=body, response=resp)
