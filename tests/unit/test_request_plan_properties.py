"""Whatever Validate run's request check accepts, every later Create call accepts: arbitrary run documents and
execution names (Step Functions' rules), then the requests as a later attempt, redrive and evaluation make them
(any counters up to the widest, any scores, any loss), each checked against botocore's model."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sdflow_common.errors import InvalidRunDocument
from sdflow_common.quality_gate import GATE_METRICS
from sdflow_common.request_plan import Unknowns, check_requests, planned_requests
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import problems_of
from sdflow_common.settings import Settings
from tests.unit.helpers import load_event
from tests.unit.job_requests import assert_valid_request

pytestmark = pytest.mark.usefixtures("aws_env")

# Step Functions' execution names (StartExecution, `name`): 1-80 characters, no whitespace, none of
# `< > { } [ ] ? * " # % \ ^ | ~ ` $ & , ; : /`, no control characters (U+0000-001F, U+007F-009F).
REFUSED_IN_NAMES = '<>{}[]?*"#%\\^|~`$&,;:/'
execution_names = st.text(
    alphabet=st.characters(exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), exclude_characters=REFUSED_IN_NAMES),
    min_size=1,
    max_size=80,
)
module_names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,30}(\.[A-Za-z0-9_]{1,8}){0,3}\Z")
s3_keys = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=1100)
numbers = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """`$.config` of events/register_model_task.json under an arbitrary name, with arbitrary values where the run
    document lets the user choose what lands in a request."""
    base = load_event("register_model_task.json")["config"]
    name = draw(execution_names)
    config = json.loads(json.dumps(base).replace(base["run_id"], json.dumps(name)[1:-1]))
    run = config["run"]
    run["run_name"] = draw(st.none() | st.from_regex(r"\A[a-zA-Z0-9\-_]{1,40}\Z"))
    run["dataset"]["url_column"] = draw(st.text(min_size=1, max_size=300))
    run["dataset"]["parquet_uris"] = [f"s3://{config['bucket']}/{draw(s3_keys)}.parquet"]
    run["endpoint"]["instance_type"] = draw(st.sampled_from(["ml.g5.xlarge", "ml.m5.large", "ml.c5.3xlarge"]))
    run["endpoint"]["name"] = draw(st.from_regex(r"\Asdflow-[a-z0-9](-?[a-z0-9]){0,40}\Z"))
    if draw(st.booleans()):
        targets = draw(st.lists(module_names, min_size=1, max_size=60, unique=True))
        run["training"] |= {"method": "lora", "plugin": "torch_ddp", "lora": {"target_modules": targets}}
    try:
        return RunConfig.model_validate(config).model_dump(mode="json")
    except ValidationError:
        assume(False)
        raise


@st.composite
def unknowns(draw: st.DrawFn) -> Unknowns:
    metrics = draw(st.lists(st.sampled_from(sorted(GATE_METRICS)), unique=True))
    scores = {
        "metrics": {name: {"trained": draw(numbers), "base": draw(numbers | st.none())} for name in metrics},
        "prompts": draw(st.integers(0, 10**6)),
        "holdout": {"grid": "holdout.png", "samples": draw(st.integers(0, 10**6))},
    }
    if not metrics:
        scores |= {"prompt_adherence": draw(numbers), "base_prompt_adherence": draw(numbers)}
    return Unknowns(
        redrive=draw(st.integers(0, 1000)),
        attempt=draw(st.integers(0, 1000)),
        scores=scores,
        loss=draw(numbers),
        package_version=draw(st.integers(1, 999_999_999)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(config=documents(), later=unknowns())
def test_check_requests_whatever_it_accepts_every_later_create_call_accepts(
    config: dict[str, Any], later: Unknowns
) -> None:
    stack = Settings.from_env()
    try:
        check_requests(copy.deepcopy(config), stack)
    except InvalidRunDocument as refused:
        problems = problems_of(refused)
    else:
        problems = []
    assert all(problem["field"] and problem["message"] for problem in problems)
    if problems:
        return

    for planned in planned_requests(config, stack, unknowns=later):
        assert_valid_request(planned.operation, planned.request)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=execution_names,
    targets=st.none() | st.lists(module_names, min_size=1, max_size=60, unique=True),
    later=unknowns(),
)
def test_check_requests_any_execution_name_and_target_list_is_shaped_never_refused(
    name: str, targets: list[str] | None, later: Unknowns
) -> None:
    """What is ours to shape (metadata and tags carrying the name, the LoRA summary) fits: a name Step Functions
    takes, a target list the document takes, never make the run refused, and every later call passes."""
    base = load_event("register_model_task.json")["config"]
    config = json.loads(json.dumps(base).replace(base["run_id"], json.dumps(name)[1:-1]))
    if targets is not None:
        lora = {"target_modules": targets}
        config["run"]["training"] |= {"method": "lora", "plugin": "torch_ddp", "lora": lora}
    try:
        config = RunConfig.model_validate(config).model_dump(mode="json")
    except ValidationError:
        assume(False)
    stack = Settings.from_env()

    check_requests(config, stack)

    for planned in planned_requests(config, stack, unknowns=later):
        assert_valid_request(planned.operation, planned.request)
