"""Find duplicates through the local cloud (issue 33): the real template, state machine, handlers, IAM and event
rules; SageMaker's jobs are no-ops (sdflow.local.sagemaker.noop), whose dedup job writes an empty summary.json.
With deduplication on, the run reaches Build dataset index through Find duplicates; off, it skips it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow import history
from sdflow.local.cloud import LocalCloud
from sdflow_common import names
from tests.e2e.clouds import CloudSpec, NoOpCloud
from tests.e2e.runs import ended, jobs_named, run_hash_of, s3_object, start_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLOUD = CloudSpec(dataset="dedup", shards=2)


def _document(noop: NoOpCloud, **sections: Any) -> dict[str, Any]:
    return noop.document(
        training={"instance_type": "ml.m5.xlarge"},
        endpoint={"name": "sdflow-dedup", "instance_type": "ml.m5.large"},
        **sections,
    )


def _states_entered(cloud: LocalCloud, arn: str) -> list[str]:
    """The top-level states in the order the run entered them."""
    events = history.fetch(cloud.client("stepfunctions"), arn)
    return [
        event["stateEnteredEventDetails"]["name"]
        for event in events
        if event["type"].endswith("StateEntered") and "stateEnteredEventDetails" in event
    ]


def test_dedup_enabled_run_reaches_the_index_through_find_duplicates(noop: NoOpCloud) -> None:
    cloud = noop.cloud
    arn = start_run(cloud, "dedup-on", _document(noop))

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    entered = _states_entered(cloud, arn)
    assert entered.index("Download shards") < entered.index("Find duplicates") < entered.index("Build dataset index")
    output = json.loads(described["output"])
    [job] = jobs_named(cloud, "processing", f"{names.DEDUP_PREFIX}-")
    assert run_hash_of(cloud, arn) in job
    assert output["dedup"] == {
        "job_name": job,
        "summary_uri": f"s3://{cloud.bucket}/runs/dedup-on/dataset/dedup/summary.json",
    }
    summary = json.loads(s3_object(cloud, output["dedup"]["summary_uri"]))
    assert (summary["version"], summary["shards"], summary["url_duplicates"]) == (1, {}, 0)
    assert output["dataset"]["shards_ok"] == CLOUD.shards


def test_dedup_disabled_run_goes_straight_to_the_index(noop: NoOpCloud) -> None:
    cloud = noop.cloud
    arn = start_run(cloud, "dedup-off", _document(noop, deduplication={"enabled": False}))

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    entered = _states_entered(cloud, arn)
    assert "Check deduplication" in entered
    assert "Find duplicates" not in entered
    assert entered.index("Check deduplication") + 1 == entered.index("Build dataset index")
    assert "dedup" not in json.loads(described["output"])
    assert not [job for job in jobs_named(cloud, "processing", f"{names.DEDUP_PREFIX}-") if "dedup-off" in job]
