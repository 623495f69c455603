"""Deploy template.yaml itself into the local cloud, the way `sam package` + `sam deploy` would.

1. Read the SAM template (CloudFormation short tags included).
2. Package: zip each function's CodeUri and each layer's ContentUri (under python/, as
   `sam build` lays a Python layer out) and upload them, and the state machine's
   DefinitionUri, to a local "artifacts" bucket; the template then points at s3:// URIs,
   which is what aws-sam-translator requires.
3. Translate SAM -> CloudFormation with aws-sam-translator, offline.
4. CreateStack in the local cloud with the parameters (defaults unless overridden) and wait.

Nothing the template says is repeated here: function names, environment variables, rules,
patterns and substitutions all come from it. What comes back is the stack's outputs and, per
function, its physical name, ARN, environment and the local folders its code came from."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sdflow.local import sessions
from sdflow.local.account import ACCOUNT_ID, REGION

log = logging.getLogger(__name__)

DEFAULT_STACK_NAME = "sdflow-local"
ARTIFACTS_BUCKET = "sdflow-local-artifacts"
SERVERLESS_FUNCTION = "AWS::Serverless::Function"
SERVERLESS_LAYER = "AWS::Serverless::LayerVersion"
SERVERLESS_STATE_MACHINE = "AWS::Serverless::StateMachine"
# Files that never belong in a deployment package.
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")
_FIXED_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # same bytes for the same files: stable CodeSha256


class TemplateError(ValueError):
    """template.yaml cannot be packaged, translated or deployed; the message names the resource."""


class _CfnLoader(yaml.SafeLoader):
    """Reads CloudFormation short-form tags (!Ref, !Sub, !GetAtt …) as {"Fn::…": value}."""


def _construct_tag(loader: _CfnLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {name: value}


_CfnLoader.add_multi_constructor("!", _construct_tag)


def load_template(path: Path) -> dict[str, Any]:
    """The template as a dict, short tags expanded."""
    try:
        document = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_CfnLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise TemplateError(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict) or "Resources" not in document:
        raise TemplateError(f"{path} is not a CloudFormation/SAM template (no Resources)")
    return document


@dataclass(frozen=True)
class DeployedFunction:
    """One function of the stack as deployed, and where its code lives on this machine."""

    logical_id: str
    name: str
    arn: str
    environment: dict[str, str]
    timeout_s: int
    code_dir: Path
    layer_dirs: tuple[Path, ...]


@dataclass
class Deployment:
    stack_name: str
    stack_id: str
    outputs: dict[str, str]
    parameters: dict[str, str]
    resources: dict[str, str]  # logical id -> physical id
    functions: dict[str, DeployedFunction] = field(default_factory=dict)


# ---------------------------------------------------------------------------- packaging


def zip_directory(folder: Path, prefix: str = "") -> bytes:
    """A deterministic zip of `folder` (files under `prefix/` inside the archive)."""
    if not folder.is_dir():
        raise TemplateError(f"{folder} is not a directory")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            relative = path.relative_to(folder)
            if path.is_dir() or _SKIP_DIRS & set(relative.parts) or path.suffix in _SKIP_SUFFIXES:
                continue
            info = zipfile.ZipInfo(str(Path(prefix) / relative) if prefix else str(relative), _FIXED_ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


def _local_path(root: Path, value: Any, logical_id: str, prop: str) -> Path | None:
    if not isinstance(value, str) or value.startswith("s3://"):
        return None
    path = (root / value).resolve()
    if not path.exists():
        raise TemplateError(f"{logical_id}.{prop} points at {value}, which does not exist under {root}")
    return path


def _global_function_property(template: Mapping[str, Any], name: str) -> Any:
    return (template.get("Globals") or {}).get("Function", {}).get(name)


def _layer_refs(template: Mapping[str, Any], props: Mapping[str, Any]) -> list[str]:
    layers = props.get("Layers", _global_function_property(template, "Layers")) or []
    return [layer["Ref"] for layer in layers if isinstance(layer, dict) and "Ref" in layer]


class _Uploader:
    def __init__(self, s3: Any, bucket: str) -> None:
        self.s3 = s3
        self.bucket = bucket

    def put(self, name: str, body: bytes) -> str:
        key = f"{name}-{hashlib.sha256(body).hexdigest()[:16]}"
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body)
        return f"s3://{self.bucket}/{key}"


def package(
    template: dict[str, Any], root: Path, uploader: _Uploader
) -> tuple[dict[str, Any], dict[str, tuple[Path, tuple[Path, ...]]]]:
    """The template with local code replaced by uploaded s3:// URIs, and per function logical id
    its code folder and layer folders (what the local runner puts on sys.path)."""
    packaged = json.loads(json.dumps(template))
    resources = packaged["Resources"]
    layer_dirs: dict[str, Path] = {}
    for logical_id, resource in resources.items():
        props = resource.setdefault("Properties", {})
        if resource.get("Type") == SERVERLESS_LAYER:
            folder = _local_path(root, props.get("ContentUri"), logical_id, "ContentUri")
            if folder is not None:
                layer_dirs[logical_id] = folder
                props["ContentUri"] = uploader.put(f"layer-{logical_id}.zip", zip_directory(folder, "python"))
        elif resource.get("Type") == SERVERLESS_STATE_MACHINE:
            definition = _local_path(root, props.get("DefinitionUri"), logical_id, "DefinitionUri")
            if definition is not None:
                props["DefinitionUri"] = uploader.put(f"statemachine-{logical_id}.json", definition.read_bytes())
    code: dict[str, tuple[Path, tuple[Path, ...]]] = {}
    for logical_id, resource in resources.items():
        if resource.get("Type") != SERVERLESS_FUNCTION:
            continue
        props = resource["Properties"]
        code_uri = props.get("CodeUri", _global_function_property(template, "CodeUri"))
        folder = _local_path(root, code_uri, logical_id, "CodeUri")
        if folder is None:
            continue
        props["CodeUri"] = uploader.put(f"function-{logical_id}.zip", zip_directory(folder))
        code[logical_id] = (folder, tuple(layer_dirs[ref] for ref in _layer_refs(template, props) if ref in layer_dirs))
    return packaged, code


# ---------------------------------------------------------------------------- translation


def parameter_values(template: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Every template parameter: its Default unless overridden; unknown overrides are refused."""
    declared = template.get("Parameters") or {}
    unknown = set(overrides or {}) - set(declared)
    if unknown:
        raise TemplateError(
            f"unknown template parameter(s) {sorted(unknown)}; the template declares {sorted(declared)}"
        )
    values: dict[str, str] = {}
    for name, spec in declared.items():
        if overrides and name in overrides:
            values[name] = str(overrides[name])
        elif "Default" in spec:
            values[name] = str(spec["Default"])
        else:
            raise TemplateError(f"template parameter {name} has no Default; pass it in parameters")
    return values


class _NoManagedPolicies:
    """aws-sam-translator asks IAM for AWS managed policy ARNs only when a function names one;
    offline there is nobody to ask."""

    def load(self) -> dict[str, str]:
        log.info("the template names an AWS managed policy; IAM is not consulted locally")
        return {}


def translate(
    template: dict[str, Any], parameters: Mapping[str, str], *, region: str, account_id: str, stack_name: str
) -> dict[str, Any]:
    """SAM -> CloudFormation with aws-sam-translator, without AWS credentials or network."""
    from samtranslator.model.exceptions import InvalidDocumentException
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator
    from samtranslator.utils.py27hash_fix import to_py27_compatible_template, undo_mark_unicode_str_in_template

    values: dict[str, Any] = {
        **parameters,
        "AWS::Region": region,
        "AWS::AccountId": account_id,
        "AWS::StackName": stack_name,
        "AWS::Partition": "aws",
        "AWS::URLSuffix": "amazonaws.com",
    }
    document = json.loads(json.dumps(template))
    to_py27_compatible_template(document, values)
    translator = Translator(None, Parser(), boto_session=sessions.session(region_name=region))
    policies = _NoManagedPolicies()
    try:
        translated = translator.translate(document, parameter_values=values, get_managed_policy_map=policies.load)
    except InvalidDocumentException as exc:
        causes = "; ".join(str(cause) for cause in exc.causes)
        raise TemplateError(f"aws-sam-translator rejected the template: {causes}") from exc
    return dict(undo_mark_unicode_str_in_template(translated))


# ---------------------------------------------------------------------------- deployment


def _client(service: str, endpoint_url: str, region: str) -> Any:
    return sessions.session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=region).client(
        service, endpoint_url=endpoint_url
    )  # type: ignore[call-overload]


def deploy(
    template_path: Path,
    endpoint_url: str,
    *,
    stack_name: str = DEFAULT_STACK_NAME,
    parameters: Mapping[str, Any] | None = None,
    region: str = REGION,
    account_id: str = ACCOUNT_ID,
    timeout_s: float = 120.0,
) -> Deployment:
    """Package, translate and create the stack in the cloud at `endpoint_url`; wait for it."""
    template_path = Path(template_path).resolve()
    template = load_template(template_path)
    s3 = _client("s3", endpoint_url, region)
    s3.create_bucket(Bucket=ARTIFACTS_BUCKET)
    packaged, code = package(template, template_path.parent, _Uploader(s3, ARTIFACTS_BUCKET))
    values = parameter_values(template, parameters)
    translated = translate(packaged, values, region=region, account_id=account_id, stack_name=stack_name)

    cfn = _client("cloudformation", endpoint_url, region)
    stack_id = cfn.create_stack(
        StackName=stack_name,
        TemplateBody=json.dumps(translated),
        Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in values.items()],
        Capabilities=["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM", "CAPABILITY_AUTO_EXPAND"],
    )["StackId"]
    stack = _wait_for_stack(cfn, stack_name, timeout_s)
    resources = {
        r["LogicalResourceId"]: r.get("PhysicalResourceId", "")
        for r in _paginate(cfn, "list_stack_resources", "StackResourceSummaries", StackName=stack_name)
    }
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    deployment = Deployment(stack_name, stack_id, outputs, values, resources)
    lambda_client = _client("lambda", endpoint_url, region)
    for logical_id, (code_dir, layer_dirs) in code.items():
        name = resources.get(logical_id)
        if not name:
            raise TemplateError(f"function {logical_id} is missing from the deployed stack {stack_name}")
        config = lambda_client.get_function_configuration(FunctionName=name)
        deployment.functions[logical_id] = DeployedFunction(
            logical_id=logical_id,
            name=config["FunctionName"],
            arn=config["FunctionArn"],
            # Lambda environment values are strings (moto echoes a Number parameter as a number).
            environment={k: str(v) for k, v in config.get("Environment", {}).get("Variables", {}).items()},
            timeout_s=int(config.get("Timeout", 3)),
            code_dir=code_dir,
            layer_dirs=layer_dirs,
        )
    return deployment


def _wait_for_stack(cfn: Any, stack_name: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stack = cfn.describe_stacks(StackName=stack_name)["Stacks"][0]
        status = stack["StackStatus"]
        if status == "CREATE_COMPLETE":
            return dict(stack)
        if not status.endswith("_IN_PROGRESS"):
            events = cfn.describe_stack_events(StackName=stack_name).get("StackEvents", [])
            reasons = [
                f"{e['LogicalResourceId']}: {e.get('ResourceStatusReason')}"
                for e in events
                if "FAILED" in e["ResourceStatus"]
            ]
            raise TemplateError(f"stack {stack_name} ended {status}: {stack.get('StackStatusReason')} {reasons}")
        if time.monotonic() > deadline:
            raise TemplateError(f"stack {stack_name} still {status} after {timeout_s:.0f} s")
        time.sleep(0.2)


def _paginate(client: Any, operation: str, key: str, **kwargs: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    token = None
    while True:
        page = client.__getattribute__(operation)(**kwargs, **({"NextToken": token} if token else {}))
        items += page.get(key, [])
        token = page.get("NextToken")
        if not token:
            return items


def repository_root() -> Path:
    """The checkout holding template.yaml (SDFLOW_ROOT overrides it)."""
    return Path(os.environ.get("SDFLOW_ROOT") or Path(__file__).resolve().parents[2])
