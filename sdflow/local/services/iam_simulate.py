"""IAM SimulatePrincipalPolicy, which moto does not implement.

The SageMaker Python SDK v3 asks it before it starts a job: ModelTrainer checks that the
execution role may do what a training job does (sagemaker/core/helper/iam_role_resolver.py,
`_simulate_denied_actions`). The answer comes from the same evaluator that enforces every call
made as a role here (sdflow.local.iam_policy over the role's inline and attached policies), so
what the simulation allows is what the role can then do.

As AWS (IAM API reference, SimulatePrincipalPolicy): ActionNames is required; ResourceArns
defaults to "*"; each action and resource pair gets an EvalDecision of `allowed`,
`explicitDeny` or `implicitDeny`; a PolicySourceArn naming no role is NoSuchEntity. Users and
groups as policy sources, permission boundaries, resource policies and context keys are not
simulated (the pipeline's principals are roles; a user source is refused by name)."""

from __future__ import annotations

from typing import Any

from sdflow.local.iam_policy import Decision, PolicySet
from sdflow.local.patching import Patch, add

DECISIONS = {
    Decision.ALLOW: "allowed",
    Decision.EXPLICIT_DENY: "explicitDeny",
    Decision.IMPLICIT_DENY: "implicitDeny",
}


def _role(arn: str) -> tuple[str, str, str]:
    """(account, partition, role name) of `arn:<partition>:iam::<account>:role/<path/>name`."""
    from moto.iam.exceptions import InvalidInput, NoSuchEntity

    parts = arn.split(":", 5)
    if len(parts) != 6 or parts[2] != "iam":
        raise InvalidInput(f"PolicySourceArn {arn!r} is not an IAM ARN")
    if not parts[5].startswith("role/"):
        raise NoSuchEntity(f"the local cloud simulates roles' policies only, not {parts[5].split('/')[0]}s")
    return parts[4], parts[1], parts[5].rsplit("/", 1)[-1]


def simulate_principal_policy(self: Any) -> Any:
    """IamResponse.simulate_principal_policy (added; moto answers NotImplementedError)."""
    from moto.core.responses import ActionResult
    from moto.iam.exceptions import InvalidInput, NoSuchEntity
    from moto.iam.models import iam_backends

    from sdflow.local.services.iam import role_policy_documents

    source = str(self._get_param("PolicySourceArn") or "")
    actions = [str(a) for a in self._get_param("ActionNames", []) or []]
    resources = [str(r) for r in self._get_param("ResourceArns", []) or []] or ["*"]
    if not actions:
        raise InvalidInput("ActionNames must name at least one action")
    account, partition, role_name = _role(source)
    if not any(role.name == role_name for role in iam_backends[account][partition].roles.values()):
        raise NoSuchEntity(f"The role with name {role_name} cannot be found.")
    policies = PolicySet.from_documents(role_policy_documents(account, partition, role_name))
    results = [
        {
            "EvalActionName": action,
            "EvalResourceName": resource,
            "EvalDecision": DECISIONS[policies.evaluate(action, resource)],
            "MatchedStatements": [],
            "MissingContextValues": [],
        }
        for action in actions
        for resource in resources
    ]
    return ActionResult({"EvaluationResults": results, "IsTruncated": False})


def patches() -> list[Patch]:
    from moto.iam.responses import IamResponse

    return [add(IamResponse, "simulate_principal_policy", simulate_principal_policy)]
