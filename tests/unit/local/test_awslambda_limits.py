"""Lambda's Invoke limits as AWS documents them: payload sizes, reserved concurrency, memory, timeouts."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.lambda_runner import FunctionSpec, LambdaRunner
from sdflow.local.services import awslambda_limits as limits
from tests.constants import REGION
from tests.unit.local.helpers import ROLE, client, records, stack, wait_for, zip_files

LIMITS_HANDLER = """
import json, os, time

def lambda_handler(event, context):
    if event.get("sleep"):
        time.sleep(event["sleep"])
    if event.get("record"):
        with open(os.environ["RECORD_FILE"], "a") as out:
            out.write(json.dumps({"record": event["record"]}) + "\\n")
    if "size" in event:
        return "A" * event["size"]
    return {"memory": context.memory_limit_in_mb, "env_memory": os.environ["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"]}
"""


@pytest.fixture
def limited(tmp_path: Path, runtime: runtime_module.Runtime) -> str:
    code = tmp_path / "limited"
    code.mkdir()
    (code / "app.py").write_text(LIMITS_HANDLER)
    client("lambda").create_function(
        FunctionName="limited",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": zip_files({"app.py": LIMITS_HANDLER})},
        Timeout=30,
        MemorySize=512,
        Environment={"Variables": {"RECORD_FILE": str(tmp_path / "events.jsonl")}},
    )
    runtime.register_code("limited", code)
    return "limited"


def _padded(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    skeleton = b'{"pad": ""}'
    return b'{"pad": "' + b"x" * (size - len(skeleton)) + b'"}'


def _error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int, str]:
    response: Any = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Message"]


def test_sync_request_over_6_mib_refused_with_413(limited: str) -> None:
    lambdas = client("lambda")
    at_limit = lambdas.invoke(FunctionName=limited, Payload=_padded(limits.SYNC_REQUEST_LIMIT))
    assert "FunctionError" not in at_limit
    with pytest.raises(ClientError) as refused:
        lambdas.invoke(FunctionName=limited, Payload=_padded(limits.SYNC_REQUEST_LIMIT + 1))
    assert _error(refused) == (
        "RequestEntityTooLargeException",
        413,
        "6291457 byte payload is too large for the RequestResponse invocation type (limit 6291456 bytes)",
    )


def test_async_request_over_1_mib_refused_with_413(limited: str) -> None:
    lambdas = client("lambda")
    accepted = lambdas.invoke(FunctionName=limited, InvocationType="Event", Payload=_padded(limits.ASYNC_REQUEST_LIMIT))
    assert accepted["StatusCode"] == 202
    with pytest.raises(ClientError) as refused:
        lambdas.invoke(FunctionName=limited, InvocationType="Event", Payload=_padded(limits.ASYNC_REQUEST_LIMIT + 1))
    assert _error(refused) == (
        "RequestEntityTooLargeException",
        413,
        "1048577 byte payload is too large for the Event invocation type (limit 1048576 bytes)",
    )


def test_response_over_limit_is_function_error_response_size_too_large(limited: str) -> None:
    lambdas = client("lambda")
    # A JSON string of n characters is n + 2 bytes; moto alone fails anything over ~6,000,000.
    fits = lambdas.invoke(FunctionName=limited, Payload=json.dumps({"size": limits.RESPONSE_LIMIT - 2}))
    assert "FunctionError" not in fits
    assert len(fits["Payload"].read()) == limits.RESPONSE_LIMIT
    over = lambdas.invoke(FunctionName=limited, Payload=json.dumps({"size": limits.RESPONSE_LIMIT - 1}))
    assert (over["StatusCode"], over["FunctionError"]) == (200, "Unhandled")
    assert json.loads(over["Payload"].read()) == {
        "errorMessage": "Response payload size exceeded maximum allowed payload size (6291556 bytes).",
        "errorType": "Function.ResponseSizeTooLarge",
    }


def test_reserved_concurrency_throttles_sync_and_queues_async(
    limited: str, tmp_path: Path, runtime: runtime_module.Runtime
) -> None:
    # botocore retries a 429 by itself (with backoff): once the busy call ended, a retry would get
    # the slot and the throttle this test is about would never reach it.
    lambdas = boto3.client("lambda", region_name=REGION, config=Config(retries={"total_max_attempts": 1}))
    lambdas.put_function_concurrency(FunctionName=limited, ReservedConcurrentExecutions=1)
    busy = threading.Thread(target=lambda: lambdas.invoke(FunctionName=limited, Payload=json.dumps({"sleep": 2})))
    busy.start()
    wait_for(lambda: runtime.lambda_concurrency.running(limits.concurrency_key(_fn(limited))) == 1, "the busy call")
    with pytest.raises(ClientError) as throttled:
        lambdas.invoke(FunctionName=limited, Payload=b"{}")
    assert _error(throttled) == ("TooManyRequestsException", 429, "Rate Exceeded.")
    assert throttled.value.response.get("Reason") == "ReservedFunctionConcurrentInvocationLimitExceeded"
    queued = lambdas.invoke(FunctionName=limited, InvocationType="Event", Payload=json.dumps({"record": "queued"}))
    assert queued["StatusCode"] == 202
    assert not records(tmp_path / "events.jsonl"), "the event waits for the busy invocation's slot"
    busy.join()
    wait_for(lambda: records(tmp_path / "events.jsonl"), what="the queued event to run")
    # The event's record is written before its invocation returns and frees the slot: a call made in
    # between is (rightly) throttled, so wait for the slot itself.
    key = limits.concurrency_key(_fn(limited))
    wait_for(lambda: runtime.lambda_concurrency.running(key) == 0, "the queued event's slot to free")
    assert "FunctionError" not in lambdas.invoke(FunctionName=limited, Payload=b"{}")


RESERVATION_REFUSED = (
    "Specified ReservedConcurrentExecutions for function decreases account's UnreservedConcurrentExecution "
    "below its minimum value of [{}]."
)


def test_reserved_concurrency_leaving_under_100_unreserved_is_refused(limited: str) -> None:
    lambdas = client("lambda")
    lambdas.put_function_concurrency(FunctionName=limited, ReservedConcurrentExecutions=900)
    with pytest.raises(ClientError) as refused:
        lambdas.put_function_concurrency(FunctionName=limited, ReservedConcurrentExecutions=901)
    assert _error(refused) == ("InvalidParameterValueException", 400, RESERVATION_REFUSED.format(100))
    assert lambdas.get_function_concurrency(FunctionName=limited)["ReservedConcurrentExecutions"] == 900


def test_reserved_concurrency_in_an_account_of_10_is_refused_at_any_value(
    limited: str, runtime: runtime_module.Runtime
) -> None:
    """A new account's quota can be 10: AWS then refuses even one reserved execution, quoting [10]."""
    runtime.lambda_account_concurrency = 10
    with pytest.raises(ClientError) as refused:
        client("lambda").put_function_concurrency(FunctionName=limited, ReservedConcurrentExecutions=1)
    assert _error(refused) == ("InvalidParameterValueException", 400, RESERVATION_REFUSED.format(10))


def test_reserved_concurrency_of_a_template_function_counts_the_other_reservations(limited: str) -> None:
    """CloudFormation creates a function with its ReservedConcurrentExecutions in one call."""
    client("lambda").put_function_concurrency(FunctionName=limited, ReservedConcurrentExecutions=850)
    client("s3").create_bucket(Bucket="artifacts")
    client("s3").put_object(Bucket="artifacts", Key="fn.zip", Body=zip_files({"app.py": LIMITS_HANDLER}))

    def function(reserved: int) -> dict[str, Any]:
        properties = {
            "FunctionName": "second",
            "Code": {"S3Bucket": "artifacts", "S3Key": "fn.zip"},
            "Handler": "app.lambda_handler",
            "Runtime": "python3.11",
            "Role": ROLE,
            "ReservedConcurrentExecutions": reserved,
        }
        return {"Fn": {"Type": "AWS::Lambda::Function", "Properties": properties}}

    # moto's CreateStack creates resources in the call: the refusal comes back through it.
    with pytest.raises(Exception, match=re.escape("below its minimum value of [100]")):
        stack(function(51))
    assert "second" not in [fn["FunctionName"] for fn in client("lambda").list_functions()["Functions"]]


def _fn(name: str) -> Any:
    from moto.awslambda.utils import get_backend

    return get_backend("123456789012", REGION).get_function(name)


def test_memory_size_reaches_the_handler(limited: str) -> None:
    answer = json.loads(client("lambda").invoke(FunctionName=limited, Payload=b"{}")["Payload"].read())
    assert answer == {"memory": 512, "env_memory": "512"}


def test_timeout_payload_has_only_aws_platform_error_keys(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(LIMITS_HANDLER)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs")
    spec = FunctionSpec("slow", "arn:aws:lambda:us-east-1:1:function:slow", "app.lambda_handler", tmp_path, timeout_s=1)
    try:
        result = runner.invoke(spec, json.dumps({"sleep": 30}), "req-1")
    finally:
        runner.shutdown()
    assert json.loads(result.payload) == {
        "errorType": "Sandbox.Timedout",
        "errorMessage": "RequestId: req-1 Error: Task timed out after 1.00 seconds",
    }
