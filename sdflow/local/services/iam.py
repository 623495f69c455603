"""IAM: every call made as a role is evaluated against that role's policies, as AWS does.

moto calls `_authenticate_and_authorize_normal_action` (moto/core/responses.py call_action) and
`_authenticate_and_authorize_s3_action` (moto/s3/responses.py) on every request; its own
implementation evaluates only when IAM simulation is on and then checks Resource "*" only
(moto/iam/access_control.py: "TODO add support for the Resource and Condition parts"). Both are
replaced here:
- every request is counted in `runtime.api_calls[(service, operation)]`;
- a request signed with credentials that STS issued for a role (the functions', the state
  machine's, the SageMaker execution role's: see `credentials_for_role`) is evaluated with
  sdflow.local.iam_policy against the role's inline and attached policies, on the resource
  ARN(s) the request acts on (sdflow/local/iam_resources.py); a denial answers AWS's error:
  AccessDeniedException for the JSON protocols, AccessDenied (403) for S3 and the query
  protocols, AuthorizationError (403) for SNS;
- any other credentials are the account's administrator (the CLI and tests: "testing") and
  are allowed, as they are on an account whose user has AdministratorAccess.
Enforcement is on when `runtime.iam` holds an IamEnforcer (LocalCloud sets one)."""

from __future__ import annotations

import json
import logging
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moto.core.authorization import ActionAuthenticatorMixin
from moto.core.exceptions import ServiceException

from sdflow.local import iam_resources, sessions
from sdflow.local.account import REGION
from sdflow.local.iam_policy import Decision, PolicySet
from sdflow.local.iam_resources import Check
from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import Runtime, runtime_or_none

log = logging.getLogger(__name__)

_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/\d{8}/([^/]+)/([^/]+)/")
# The IAM prefix of a service whose SigV4 signing name differs from it.
_SIGNING_TO_IAM = {"monitoring": "cloudwatch"}
# How long a role session lasts; 12 hours is the most a role's MaxSessionDuration allows.
SESSION_SECONDS = 43_200
# (IAM prefix) -> (error code, HTTP status) where AWS does not answer AccessDeniedException/400.
_DENIAL = {
    "sns": ("AuthorizationError", 403),  # SNS API reference, Common Errors: AuthorizationError, 403
    "sts": ("AccessDenied", 403),
    "iam": ("AccessDenied", 403),
    "cloudwatch": ("AccessDenied", 403),
    "sqs": ("AccessDenied", 403),
}


@dataclass(frozen=True)
class Principal:
    account: str
    role_name: str
    arn: str  # arn:aws:sts::<account>:assumed-role/<role>/<session>, as AWS names the caller


class AccessDenied(Exception):
    """A role's request that its policies do not allow."""

    def __init__(self, principal: Principal, check: Check, decision: Decision) -> None:
        why = (
            "with an explicit deny in an identity-based policy"
            if decision is Decision.EXPLICIT_DENY
            else (f"because no identity-based policy allows the {check.action} action")
        )
        # AWS's wording (IAM User Guide, troubleshoot_access-denied.html).
        super().__init__(
            f"User: {principal.arn} is not authorized to perform: {check.action} on resource: {check.resource} {why}"
        )


class _DeniedError(ServiceException):
    """The denial as the service's serializer writes it (code and message set per request)."""


class IamEnforcer:
    """The roles' credentials and parsed policies; thread-safe. Lives on `runtime.iam`."""

    def __init__(self, region: str = REGION) -> None:
        self.region = region
        self._lock = threading.Lock()
        self._credentials: dict[tuple[str, str], dict[str, str]] = {}
        self._principals: dict[str, Principal | None] = {}
        self._policies: dict[tuple[str, str], PolicySet] = {}
        self._logged_unknown: set[tuple[str, str]] = set()
        # Task token -> the state machine ARN SendTask* is authorized against (a Map Run child's own).
        self.token_owners: dict[str, str] = {}

    def credentials_for_role(self, role_arn: str, session_name: str) -> dict[str, str]:
        """Environment variables with STS credentials of the role (one session per role and name)."""
        from moto.sts.models import sts_backends
        from moto.utilities.utils import get_partition

        key = (role_arn, session_name)
        with self._lock:
            found = self._credentials.get(key)
            if found is None:
                account = role_arn.split(":")[4]
                session = sts_backends[account][get_partition(self.region)].assume_role(
                    region_name=self.region,
                    role_session_name=session_name[:64],
                    role_arn=role_arn,
                    policy="",
                    duration=SESSION_SECONDS,
                    external_id="",
                )
                found = self._credentials[key] = {
                    "AWS_ACCESS_KEY_ID": session.access_key_id,
                    "AWS_SECRET_ACCESS_KEY": session.secret_access_key,
                    "AWS_SESSION_TOKEN": session.session_token,
                }
                self._principals[session.access_key_id] = Principal(account, role_arn.rsplit("/", 1)[-1], session.arn)
        return found

    def principal(self, access_key: str) -> Principal | None:
        """The role session behind an access key; None for the administrator's keys."""
        try:
            return self._principals[access_key]
        except KeyError:
            pass
        found = _assumed_role(access_key) if access_key.startswith("ASIA") else None
        with self._lock:
            self._principals[access_key] = found
        return found

    def policies(self, principal: Principal) -> PolicySet:
        key = (principal.account, principal.role_name)
        found = self._policies.get(key)
        if found is None:
            from moto.utilities.utils import get_partition

            documents = role_policy_documents(principal.account, get_partition(self.region), principal.role_name)
            found = PolicySet.from_documents(documents)
            with self._lock:
                self._policies[key] = found
        return found

    def forget_policies(self) -> None:
        """A role or policy may have changed (an IAM or CloudFormation write): parse again."""
        with self._lock:
            self._policies.clear()

    def check(self, principal: Principal, checks: list[Check]) -> None:
        policies = self.policies(principal)
        for check in checks:
            decision = policies.evaluate(check.action, check.resource, check.context)
            if decision is not Decision.ALLOW:
                raise AccessDenied(principal, check, decision)

    def note_unknown(self, service: str, operation: str) -> None:
        if (service, operation) not in self._logged_unknown:
            self._logged_unknown.add((service, operation))
            log.info("IAM: no resource mapping for %s:%s; evaluated against Resource '*'", service, operation)


def _assumed_role(access_key: str) -> Principal | None:
    """A role session STS issued outside credentials_for_role (e.g. a test's own AssumeRole)."""
    from moto.iam.models import get_account_id_from
    from moto.sts.models import sts_backends

    account = get_account_id_from(access_key)
    session = sts_backends[account]["aws"].get_assumed_role_from_access_key(access_key)
    if session is None:
        return None
    return Principal(account, session.role_arn.rsplit("/", 1)[-1], session.arn)


def role_policy_documents(account: str, partition: str, role_name: str) -> dict[str, Any]:
    """The role's inline and attached policies (a missing role has none: everything is denied)."""
    from moto.iam.models import iam_backends

    documents: dict[str, Any] = {}
    role = next((r for r in iam_backends[account][partition].roles.values() if r.name == role_name), None)
    if role is None:
        return documents
    for name, document in role.policies.items():
        documents[f"{role_name}/{name}"] = document
    for arn, managed in role.managed_policies.items():
        default = next(v for v in managed.versions if v.is_default)
        documents[arn] = default.document
    return documents


# ------------------------------------------------------------------------------ the request hook


def _scope(responder: Any) -> tuple[str, str, str] | None:
    """(access key, region, IAM service prefix) from the SigV4 header or a presigned URL."""
    header = responder.headers.get("Authorization") or ""
    match = _CREDENTIAL.search(header)
    if match is None:
        credential = (getattr(responder, "querystring", None) or {}).get("X-Amz-Credential")
        match = _CREDENTIAL.search("Credential=" + credential[0]) if credential else None
    if match is None:
        return None
    access_key, region, signing_name = match.groups()
    return access_key, region, _SIGNING_TO_IAM.get(signing_name, signing_name)


def _count(runtime: Runtime, service: str, operation: str) -> None:
    with runtime.api_calls_lock:
        runtime.api_calls[(service, operation)] += 1


def _injected_error(runtime: Runtime, service: str, operation: str) -> tuple[str, str, int] | None:
    """The error faults.fail_api_calls armed for this call, if any (one call used up)."""
    with runtime.faults_lock:
        armed = runtime.api_errors.get((service, operation))
        if armed is None:
            return None
        code, message, status, remaining = armed
        if remaining <= 1:
            del runtime.api_errors[(service, operation)]
        else:
            armed[3] = remaining - 1
        return code, message, status


def _params(responder: Any) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key, values in (getattr(responder, "querystring", None) or {}).items():
        params[key] = values[0] if isinstance(values, list) and values else values
    body = getattr(responder, "body", None)
    if isinstance(body, dict):
        params.update(body)
    elif body and isinstance(body, (str, bytes)) and body[:1] in ("{", b"{"):
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            params.update(parsed)
    parsed_params = getattr(responder, "params", None)
    if isinstance(parsed_params, dict):
        params.update(parsed_params)
    params.update(getattr(responder, "uri_match", None) or {})
    return params


def _evaluate(
    responder: Any,
    runtime: Runtime,
    operation: str,
    derive: Callable[[str, dict[str, Any], str, str], list[Check] | None],
) -> None:
    scope = _scope(responder)
    service = scope[2] if scope else str(getattr(responder, "service_name", "") or "unknown")
    _count(runtime, service, operation)
    enforcer = runtime.iam
    if enforcer is None or scope is None:
        return
    if service in ("iam", "cloudformation") and not operation.startswith(("Get", "List", "Describe")):
        enforcer.forget_policies()
    principal = enforcer.principal(scope[0])
    if principal is None:
        return  # the account's administrator
    checks = derive(service, _params(responder), scope[1], principal.account)
    if checks is None:
        enforcer.note_unknown(service, operation)
        checks = [Check(f"{service}:{operation}", "*")]
    enforcer.check(principal, checks)


def authorize_normal_action(inner: Any, self: Any, resource: str = "*") -> None:
    """Replaces ActionAuthenticatorMixin._authenticate_and_authorize_normal_action (every
    non-S3 request, from moto/core/responses.py BaseResponse.call_action)."""
    runtime = runtime_or_none()
    if runtime is None:
        return inner(self, resource)
    operation = self._get_action()
    scope = _scope(self)
    service = scope[2] if scope else str(getattr(self, "service_name", "") or "unknown")
    try:
        _evaluate(self, runtime, operation, lambda s, p, r, a: iam_resources.checks(self, s, operation, p, r, a))
    except AccessDenied as denied:
        code, status = _DENIAL.get(service, ("AccessDeniedException", 400))
        raise _http_error(self, code, str(denied), status) from None
    injected = _injected_error(runtime, service, operation)
    if injected is not None:
        raise _http_error(self, injected[0], injected[1], injected[2])


def _http_error(responder: Any, code: str, message: str, status: int) -> Exception:
    """An error answered in the service's own protocol (its serializer writes code and message)."""
    from moto.core.responses import ActionResult
    from werkzeug.exceptions import HTTPException

    _status, headers, body = responder.serialized(ActionResult(_DeniedError(code, message)))
    responder.response_headers.update({k: v for k, v in headers.items() if k.lower() != "status"})
    http_error = HTTPException(description=body)
    http_error.code = status
    return http_error


def authorize_s3_action(inner: Any, self: Any, bucket_name: str | None = None, key_name: str | None = None) -> None:
    """Replaces ActionAuthenticatorMixin._authenticate_and_authorize_s3_action (moto's S3
    handlers call it with the IAM action name already in self.data["Action"])."""
    from moto.s3.exceptions import S3ClientError

    runtime = runtime_or_none()
    if runtime is None:
        return inner(self, bucket_name, key_name)
    action = str(self.data.get("Action") or "Unknown")
    try:
        _evaluate(
            self,
            runtime,
            action,
            lambda s, p, r, a: iam_resources.s3_checks(action, bucket_name, key_name, self.headers, p),
        )
    except AccessDenied as denied:
        raise S3ClientError("AccessDenied", str(denied)) from None


# ------------------------------------------------------------------------------ the interpreter


def interpreter_client(region: str, service: str, state_credentials: Any = None) -> Any | None:
    """A boto3 client for moto's Step Functions interpreter that signs as the execution's role
    (StateCredentials.role_arn: the state machine's RoleArn, or a Task's Credentials.RoleArn),
    as Step Functions calls integrated services with it; one per (port, region, service, role).
    None when IAM is not enforced or moto runs in-process: the caller then builds moto's own
    client (moto/stepfunctions/parser/asl/utils/boto_client.py boto_client_for, fixed keys)."""
    from botocore.config import Config
    from moto.core.models import botocore_stubber
    from moto.settings import moto_server_port
    from moto.stepfunctions.parser.asl.component.common.timeouts.timeout import TimeoutSeconds

    runtime = runtime_or_none()
    role_arn = getattr(state_credentials, "role_arn", None)
    if runtime is None or runtime.iam is None or not role_arn or botocore_stubber.enabled:
        return None
    port = moto_server_port()
    key = (port, region, f"{service} as {role_arn}")
    with runtime.sfn_clients_lock:
        client = runtime.sfn_clients.get(key)
        if client is None:
            keys = runtime.iam.credentials_for_role(role_arn, "StepFunctions")
            if runtime.sfn_session is None:
                runtime.sfn_session = sessions.session()
            client = runtime.sfn_clients[key] = runtime.sfn_session.client(
                service,
                region_name=region,
                endpoint_url=f"http://localhost:{port}",
                aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
                aws_session_token=keys["AWS_SESSION_TOKEN"],
                config=Config(
                    parameter_validation=False,
                    retries={"max_attempts": 0, "total_max_attempts": 1},
                    connect_timeout=TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                    read_timeout=TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                ),
            )
    return client


# ------------------------------------------------------------------------------ task tokens


def map_worker_eval_job(inner: Any, self: Any, env: Any, job: Any) -> None:
    """Wraps moto's DistributedItemProcessorWorker._eval_job: marks the child's context object
    with the child's own state machine ARN `<machine>/<label>` (MapRunRecord.map_state_machine_arn),
    which is what SendTask* for the tokens it mints is authorized against on AWS."""

    env.states.context_object.sdflow_map_child_arn = self._map_run_record.map_state_machine_arn
    inner(self, env, job)


def update_task_token(inner: Any, self: Any) -> str:
    """Wraps moto's ContextObject.update_task_token (moto/stepfunctions/parser/asl/eval/states.py):
    a token minted in a Distributed Map child is recorded as that child's."""

    token = str(inner(self))
    child = getattr(self, "sdflow_map_child_arn", None)
    runtime = runtime_or_none()
    if child and runtime is not None and runtime.iam is not None:
        runtime.iam.token_owners[token] = child
    return token


def patches() -> list[Patch]:
    # Denials are serialized as unmodelled errors on purpose; moto warns about each one.
    warnings.filterwarnings("ignore", message=r"Exception\(_DeniedError\)")
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (  # noqa: E501
        DistributedItemProcessorWorker,
    )
    from moto.stepfunctions.parser.asl.eval.states import ContextObject

    return [
        wrap(ActionAuthenticatorMixin, "_authenticate_and_authorize_normal_action", authorize_normal_action),
        wrap(ActionAuthenticatorMixin, "_authenticate_and_authorize_s3_action", authorize_s3_action),
        wrap(DistributedItemProcessorWorker, "_eval_job", map_worker_eval_job),
        wrap(ContextObject, "update_task_token", update_task_token),
    ]
