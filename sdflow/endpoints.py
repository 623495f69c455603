"""Calling a deployed endpoint: the serving container's contract (docs/contracts.md), for
`sdflow invoke`, sdflow.sdk's Predictor and the run console.

Request: JSON `{"prompt": ..., <options>}`; answer: JSON `{"images": [<base64 PNG>, ...]}`.

A busy endpoint refuses a request it cannot finish within SageMaker's 60 s (429 "busy" with
`retry_after_s` in its body, training_image/sdflow_image/serving/serve_admission.py). SageMaker hands
every container 4xx/5xx on as ModelError (424) with the container's status in
`OriginalStatusCode` and its body in `OriginalMessage`, and no SDK retries a ModelError (the
local sagemaker-runtime's docstring, sdflow/local/sagemaker/invoke.py, says what AWS documents).
So the retry of a busy refusal is ours: after the seconds the endpoint asked for, within
BUSY_RETRY_BUDGET_S in all."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from botocore.exceptions import ClientError

from sdflow.errors import EndpointError


class Session(Protocol):
    """What is needed of sdflow.session.Session (not imported: it reaches the console, whose page
    calls invoke_json)."""

    def client(self, service: str) -> Any: ...


BUSY_STATUS = 429
# A person waiting at `sdflow invoke` (or a notebook cell): a few minutes at most.
BUSY_RETRY_BUDGET_S = 180.0
# When a busy answer does not say how long to wait.
DEFAULT_RETRY_AFTER_S = 5.0


def busy_retry_after(exc: ClientError) -> float | None:
    """The seconds a busy endpoint asked the caller to wait, or None when `exc` is no busy refusal."""
    response: Any = exc.response
    if response.get("Error", {}).get("Code") != "ModelError" or response.get("OriginalStatusCode") != BUSY_STATUS:
        return None
    try:
        body = json.loads(response.get("OriginalMessage") or "{}")
        wait = float(body.get("retry_after_s", DEFAULT_RETRY_AFTER_S))
    except (TypeError, ValueError, AttributeError):
        wait = DEFAULT_RETRY_AFTER_S
    return max(wait, 0.1)


def invoke_json(
    client: Any,
    endpoint: str,
    body: dict[str, Any],
    *,
    budget_s: float = BUSY_RETRY_BUDGET_S,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> Any:
    """InvokeEndpoint with `body` as JSON; a busy refusal is retried after the wait it names while
    the budget lasts. Any other error, or a busy one past the budget, is raised as it came."""
    sleep, clock = sleep or time.sleep, clock or time.monotonic
    deadline = clock() + budget_s
    while True:
        try:
            response = client.invoke_endpoint(
                EndpointName=endpoint, ContentType="application/json", Accept="application/json", Body=json.dumps(body)
            )
        except ClientError as exc:
            wait = busy_retry_after(exc)
            if wait is None or clock() + wait > deadline:
                raise
            sleep(wait)
            continue
        return json.loads(response["Body"].read())


def generate(session: Session, endpoint: str, prompt: str, **options: Any) -> bytes:
    """The first image the endpoint makes for `prompt`, as PNG bytes; options left None are not sent."""
    body = {"prompt": prompt, **{k: v for k, v in options.items() if v is not None}}
    try:
        answer = invoke_json(session.client("sagemaker-runtime"), endpoint, body)
    except ClientError as exc:
        # ModelError carries the model's own answer (e.g. a 400 naming the bad field) in OriginalMessage.
        error = exc.response.get("Error", {})
        detail = exc.response.get("OriginalMessage") or error.get("Message", "")
        busy = f" (still busy after retrying for {BUSY_RETRY_BUDGET_S:.0f} s)" if busy_retry_after(exc) else ""
        raise EndpointError(
            f"endpoint {endpoint} refused the request ({error.get('Code', 'error')}){busy}: {detail}"
        ) from None
    images = answer.get("images") if isinstance(answer, dict) else None
    if not images:
        raise EndpointError(f"endpoint {endpoint} answered without an image: {str(answer)[:300]}")
    return base64.b64decode(images[0])


def invoke(session: Session, endpoint: str, prompt: str, output: Path, **options: Any) -> Path:
    """generate(), written to `output`."""
    image = generate(session, endpoint, prompt, **options)
    output.write_bytes(image)
    return output
