"""Calling a deployed endpoint: the serving container's contract (docs/contracts.md), for
`sdflow invoke` and sdflow.sdk's Predictor.

Request: JSON `{"prompt": ..., <options>}`; answer: JSON `{"images": [<base64 PNG>, ...]}`."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from sdflow.errors import EndpointError
from sdflow.session import Session


def generate(session: Session, endpoint: str, prompt: str, **options: Any) -> bytes:
    """The first image the endpoint makes for `prompt`, as PNG bytes; options left None are not sent."""
    body = {"prompt": prompt, **{k: v for k, v in options.items() if v is not None}}
    try:
        response = session.client("sagemaker-runtime").invoke_endpoint(
            EndpointName=endpoint, ContentType="application/json", Accept="application/json", Body=json.dumps(body)
        )
    except ClientError as exc:
        # ModelError carries the model's own answer (e.g. a 400 naming the bad field) in OriginalMessage.
        error = exc.response.get("Error", {})
        detail = exc.response.get("OriginalMessage") or error.get("Message", "")
        raise EndpointError(
            f"endpoint {endpoint} refused the request ({error.get('Code', 'error')}): {detail}"
        ) from None
    answer = json.loads(response["Body"].read())
    images = answer.get("images") if isinstance(answer, dict) else None
    if not images:
        raise EndpointError(f"endpoint {endpoint} answered without an image: {str(answer)[:300]}")
    return base64.b64decode(images[0])


def invoke(session: Session, endpoint: str, prompt: str, output: Path, **options: Any) -> Path:
    """generate(), written to `output`."""
    image = generate(session, endpoint, prompt, **options)
    output.write_bytes(image)
    return output
