"""What cli/tests/deploy_live.rs asks of Python (the emulators' venv, which has boto3 and PyYAML).

    python deploy_kit.py json FILE
        every YAML document of FILE as one JSON list on stdout; CloudFormation's short tags
        (`!Ref X`, `!Sub s`, `!Condition C`) read as their long forms ({"Ref": X},
        {"Fn::Sub": s}, {"Condition": C}).
    python deploy_kit.py deploy STACK TEMPLATE [KEY=VALUE ...]
        creates the stack and waits for it; prints {"status", "reason", "outputs", "failed"} as
        JSON on stdout; exits 1 unless the stack reached CREATE_COMPLETE.
    python deploy_kit.py delete STACK
        deletes the stack and waits for it to go.

CloudFormation and IAM are reached at AWS_ENDPOINT_URL_CLOUDFORMATION and AWS_ENDPOINT_URL_IAM
when set (boto3 reads them), in AWS_REGION.
"""

import json
import os
import sys
import time

import yaml


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader, suffix, node):
    # `!Ref` and `!Condition` have no `Fn::` in their long forms.
    name = suffix if suffix in ("Ref", "Condition") else "Fn::" + suffix
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    # `!GetAtt A.B` is the short form of {"Fn::GetAtt": ["A", "B"]}.
    if name == "Fn::GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {name: value}


_Loader.add_multi_constructor("!", _tagged)


def to_json(path):
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.load_all(f, Loader=_Loader) if d is not None]
    json.dump(docs, sys.stdout)
    print()


def _client(service="cloudformation"):
    import boto3

    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client(service, region_name=region)


def _wait(cfn, stack, until, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = cfn.describe_stacks(StackName=stack)["Stacks"]
        except cfn.exceptions.ClientError as e:
            if "does not exist" in str(e):
                return None
            raise
        status = found[0]["StackStatus"] if found else None
        if status is None or not status.endswith("_IN_PROGRESS") or status in until:
            return found[0] if found else None
        if time.monotonic() > deadline:
            raise SystemExit(f"stack {stack} still {status} after {timeout} s")
        time.sleep(0.2)


def deploy(stack, template, params):
    cfn = _client()
    with open(template, encoding="utf-8") as f:
        body = f.read()
    parameters = []
    for p in params:
        key, _, value = p.partition("=")
        parameters.append({"ParameterKey": key, "ParameterValue": value})
    cfn.create_stack(
        StackName=stack,
        TemplateBody=body,
        Parameters=parameters,
        Capabilities=["CAPABILITY_IAM"],
    )
    found = _wait(cfn, stack, ())
    status = found["StackStatus"] if found else "GONE"
    failed = []
    if status != "CREATE_COMPLETE":
        for e in cfn.describe_stack_events(StackName=stack)["StackEvents"]:
            if e.get("ResourceStatus", "").endswith("FAILED"):
                failed.append(
                    {
                        "resource": e.get("LogicalResourceId"),
                        "reason": e.get("ResourceStatusReason"),
                    }
                )
    outputs = {o["OutputKey"]: o["OutputValue"] for o in (found or {}).get("Outputs", [])}
    json.dump(
        {
            "status": status,
            "reason": (found or {}).get("StackStatusReason"),
            "outputs": outputs,
            "failed": failed,
        },
        sys.stdout,
    )
    print()
    return 0 if status == "CREATE_COMPLETE" else 1


def delete(stack):
    cfn = _client()
    # moto deletes a role before the policy attached to it, IAM refuses, and the stack is gone
    # with the role and policy left: detach them first (CloudFormation would, in its order).
    iam = _client("iam")
    for r in cfn.describe_stack_resources(StackName=stack)["StackResources"]:
        if r["ResourceType"] == "AWS::IAM::Role":
            role = r["PhysicalResourceId"]
            for p in iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]:
                iam.detach_role_policy(RoleName=role, PolicyArn=p["PolicyArn"])
    cfn.delete_stack(StackName=stack)
    _wait(cfn, stack, ())
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "json":
        to_json(argv[1])
        return 0
    if len(argv) >= 3 and argv[0] == "deploy":
        return deploy(argv[1], argv[2], argv[3:])
    if len(argv) == 2 and argv[0] == "delete":
        return delete(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
