"""Property: no request to /invocations, however malformed, gets a 5xx (it is the caller's fault,
so a 4xx naming the field), and every refusal is a JSON body saying why.

The pipeline is a stand-in that answers at once (the real one is exercised in test_serve*.py);
what is fuzzed is everything in front of it: headers, content types, body bytes, JSON shapes,
text with lone surrogates, nesting deep enough to exhaust Python's recursion, and request sizes
past the 60 s limit (the stand-in's timing makes the largest requests too slow)."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdflow_image.serving import serve
from sdflow_image.serving.serve_model import ServeSettings, StepTiming
from sdflow_image.serving.serve_request import REQUEST_FIELDS
from tests.image.serve_fixtures import InstantPipeline, fixed_timing, wait_until

pytestmark = [pytest.mark.image, pytest.mark.slow]

# 0.02 s a step at 64²: 4 images x 150 steps at 1024² would take ~3 hours, 1 x 30 at 64² 0.6 s.
TIMING = StepTiming(size=64, step_s=0.02, overhead_s=0.0)


@pytest.fixture(scope="module")
def fuzz_client() -> Iterator[tuple[TestClient, InstantPipeline]]:
    pipe = InstantPipeline()
    app = serve.create_app(
        ServeSettings(model_dir=Path("/nonexistent")), loader=lambda s: pipe, calibrator=fixed_timing(TIMING)
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_until(lambda: client.get("/ping").status_code == 200, "the stand-in to load")
        yield client, pipe


# Any code point, lone surrogates included (hypothesis leaves them out unless asked).
any_char = st.characters(codec=None, categories=None) | st.characters(categories=["Cs"])
any_text = st.text(any_char, max_size=40)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=12
)
near_valid = {
    "prompt": any_text | st.text(string.ascii_letters + " ", min_size=1, max_size=30),
    "negative_prompt": st.none() | any_text,
    "num_inference_steps": st.integers(-2, 200) | json_values,
    "guidance_scale": st.floats(-1, 40) | json_values,
    "seed": st.integers(-1, 2**64) | json_values,
    "width": st.sampled_from([None, 0, 63, 64, 72, 512, 1024, 1032, 4096]) | json_values,
    "height": st.sampled_from([None, 0, 64, 80, 1024, 2**40]) | json_values,
    "num_images": st.integers(-1, 6) | json_values,
}
requests = st.fixed_dictionaries(
    {},
    optional={**near_valid, "style": json_values},
) | st.dictionaries(st.sampled_from(REQUEST_FIELDS) | any_text, json_values, max_size=6)


sizes = st.integers(8, 128).map(lambda n: n * 8)  # 64..1024 and beyond, multiples of 8
# Well-formed requests: run by the stand-in or refused for the 60 s limit, depending on their size.
valid_requests = st.fixed_dictionaries(
    {"prompt": st.text(string.ascii_letters + " ", min_size=1, max_size=30).filter(str.strip)},
    optional={
        "num_inference_steps": st.integers(1, 150),
        "num_images": st.integers(1, 4),
        "width": sizes,
        "height": sizes,
        "seed": st.integers(0, 2**63 - 1),
        "guidance_scale": st.floats(0, 30),
        "negative_prompt": any_text,
    },
)


def _encode(value: Any, ascii_only: bool) -> bytes:
    # ensure_ascii escapes surrogates as \udxxx; otherwise they become (invalid) UTF-8 bytes.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def _nested(depth: int, opener: bytes, inner: bytes, closer: bytes) -> bytes:
    return opener * depth + inner + closer * depth


bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(_encode, requests, st.booleans()),
    st.builds(_encode, valid_requests, st.booleans()),
    st.builds(_encode, valid_requests, st.booleans()),
    st.builds(_encode, json_values, st.booleans()),
    st.builds(
        _nested,
        st.integers(1, 30_000),
        st.sampled_from([b"[", b'{"a":', b'{"prompt":']),
        st.just(b"1"),
        st.sampled_from([b"]", b"}"]),
    ),
    st.builds(lambda depth: b'{"prompt": "x", "seed": ' + b"[" * depth + b"]" * depth + b"}", st.integers(1, 2000)),
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
content_types = (
    st.none()
    | st.sampled_from(
        ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "", ";", "image/png"]
    )
    | header_text
)
accepts = (
    st.none()
    | st.sampled_from(
        ["*/*", "image/png", "application/json;q=0", "image/*;q=nan", "image/png;q=inf, */*;q=0.1", "text/html", ","]
    )
    | header_text
)
extra_headers = st.dictionaries(
    st.sampled_from(["X-Amzn-SageMaker-Custom-Attributes", "X-Amzn-SageMaker-Target-Model", "Content-Encoding", "X-A"]),
    header_text,
    max_size=2,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, content_type=content_types, accept=accepts, headers=extra_headers)
def test_invocations_any_request_returns_below_500_with_a_reason(
    fuzz_client: tuple[TestClient, InstantPipeline],
    body: bytes,
    content_type: str | None,
    accept: str | None,
    headers: dict[str, str],
) -> None:
    client, _ = fuzz_client
    sent = dict(headers)
    if content_type is not None:
        sent["Content-Type"] = content_type
    if accept is not None:
        sent["Accept"] = accept
    response = client.post("/invocations", content=body, headers=sent)
    assert response.status_code < 500, (response.status_code, response.text[:500], body[:200], sent)
    if response.status_code != 200:
        reason = response.json()
        assert isinstance(reason["error"], str)
        assert reason["error"]
        if response.status_code == 400:
            assert reason["field"], reason
