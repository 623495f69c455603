"""SageMaker's ListProcessingJobs and ListTrainingJobs, as AWS pages and filters them.

The run's cleanup finds its jobs with `NameContains=<run hash>` and a status, so the listing must
show the local jobs' live statuses (InProgress while the local process runs, Stopping, Stopped,
Completed, Failed: sagemaker/service.py keeps moto's job objects current) and page like AWS:

- SortBy (CreationTime | Name | Status, default CreationTime) and SortOrder (default Ascending)
  are honoured (ListTrainingJobs / ListProcessingJobs request reference: "The default is
  CreationTime", "The default is Ascending"); moto ignores both.
- The name and time filters select before the page is cut; moto cuts the page first, so a filtered
  listing could end early or skip jobs.
- ListTrainingJobs applies StatusEquals after the page is cut, as its reference documents ("the
  MaxResults number of training jobs are first retrieved ignoring the StatusEquals parameter and
  then they are filtered by the StatusEquals parameter"): a page may hold fewer than MaxResults
  jobs, even none, and still carry a NextToken, so callers must follow NextToken to the end.
  ListProcessingJobs documents no such rule and filters the status first.
- Without MaxResults a page holds 10 jobs (AWS's page size when MaxResults is absent; the
  reference gives only the range 1-100), so a caller that ignores NextToken misses jobs here
  as it would on AWS.
- Summaries carry what AWS's do and moto's lack: SecondaryStatus (TrainingJobSummary),
  FailureReason and ExitMessage (ProcessingJobSummary).

Both are rate limited on their own token bucket (sagemaker/quotas.py: 2 calls a second, as users
report ListTrainingJobs' account-wide rate): a call over it answers ThrottlingException "Rate
exceeded".

The NextToken is opaque: the offset into the sorted, filtered list, base64-encoded; a token that
does not decode is refused with ValidationException, as AWS refuses a token it did not issue."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from collections.abc import Callable, Iterable
from typing import Any

from sdflow.local.patching import Patch, replace
from sdflow.local.runtime import runtime_or_none
from sdflow.local.sagemaker import quotas
from sdflow.local.sagemaker.service import ThrottlingException

DEFAULT_MAX_RESULTS = 10
MAX_RESULTS = 100
SORT_BY = ("Name", "CreationTime", "Status")
SORT_ORDER = ("Ascending", "Descending")
JOB_STATUSES = ("InProgress", "Completed", "Failed", "Stopping", "Stopped")


def _validation_error(message: str) -> Exception:
    from moto.sagemaker.exceptions import ValidationError

    return ValidationError(message=message)


def _timestamp(value: Any, field_name: str) -> dt.datetime | None:
    """boto3 sends timestamps as epoch seconds in SageMaker's JSON protocol."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, dt.UTC)
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise _validation_error(f"{field_name} must be a timestamp, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _aware(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    return dt.datetime.fromtimestamp(float(value), dt.UTC)


def _enum_error(value: Any, field_name: str, allowed: Iterable[str]) -> str:
    return (
        f"Value '{value}' at '{field_name}' failed to satisfy constraint: "
        f"Member must satisfy enum value set: [{', '.join(allowed)}]"
    )


def encode_token(offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"offset": offset}).encode()).decode()


def decode_token(token: str | None) -> int:
    if not token:
        return 0
    try:
        offset = json.loads(base64.urlsafe_b64decode(token.encode()))["offset"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        offset = None
    if not isinstance(offset, int) or offset < 0:
        raise _validation_error(f'Invalid pagination token because "{token}" was not issued by this listing.')
    return offset


class ListRequest:
    """The common request fields of ListProcessingJobs / ListTrainingJobs, validated as AWS does."""

    def __init__(self, response: Any) -> None:
        get = response._get_param
        self.max_results = get("MaxResults")
        self.sort_by = get("SortBy") or "CreationTime"
        self.sort_order = get("SortOrder") or "Ascending"
        self.status_equals = get("StatusEquals")
        self.name_contains = get("NameContains")
        errors = []
        if self.max_results is not None and not (
            isinstance(self.max_results, int) and 1 <= self.max_results <= MAX_RESULTS
        ):
            errors.append(
                f"Value '{self.max_results}' at 'maxResults' failed to satisfy constraint: "
                f"Member must have value between 1 and {MAX_RESULTS}"
            )
        if self.sort_by not in SORT_BY:
            errors.append(_enum_error(self.sort_by, "sortBy", SORT_BY))
        if self.sort_order not in SORT_ORDER:
            errors.append(_enum_error(self.sort_order, "sortOrder", SORT_ORDER))
        if self.status_equals is not None and self.status_equals not in JOB_STATUSES:
            errors.append(_enum_error(self.status_equals, "statusEquals", JOB_STATUSES))
        if errors:
            noun = "error" if len(errors) == 1 else "errors"
            raise _validation_error(f"{len(errors)} validation {noun} detected: {'; '.join(errors)}")
        self.offset = decode_token(get("NextToken"))
        self.created_after = _timestamp(get("CreationTimeAfter"), "CreationTimeAfter")
        self.created_before = _timestamp(get("CreationTimeBefore"), "CreationTimeBefore")
        self.modified_after = _timestamp(get("LastModifiedTimeAfter"), "LastModifiedTimeAfter")
        self.modified_before = _timestamp(get("LastModifiedTimeBefore"), "LastModifiedTimeBefore")

    def selects(self, name: str, created: Any, modified: Any) -> bool:
        if self.name_contains is not None and self.name_contains not in name:
            return False
        checks = (
            (self.created_after, created, 1),
            (self.created_before, created, -1),
            (self.modified_after, modified, 1),
            (self.modified_before, modified, -1),
        )
        for bound, value, sign in checks:
            if bound is not None and not (_aware(value) > bound if sign > 0 else _aware(value) < bound):
                return False
        return True

    def page(
        self,
        jobs: list[Any],
        name: Callable[[Any], str],
        status: Callable[[Any], str],
        *,
        status_after_page: bool,
    ) -> tuple[list[Any], str | None]:
        """The jobs of this page and the next page's token (None on the last page)."""
        chosen = [j for j in jobs if self.selects(name(j), j.creation_time, j.last_modified_time)]
        if self.status_equals is not None and not status_after_page:
            chosen = [j for j in chosen if status(j) == self.status_equals]
        keys: dict[str, Callable[[Any], Any]] = {
            "Name": name,
            "CreationTime": lambda j: _aware(j.creation_time),
            "Status": status,
        }
        # Ties (same second) keep creation order, so that pages do not shuffle between calls.
        chosen.sort(key=keys[self.sort_by], reverse=self.sort_order == "Descending")
        if self.offset > len(chosen):
            raise _validation_error(f"Invalid pagination token: offset {self.offset} is past the end of the listing.")
        size = self.max_results or DEFAULT_MAX_RESULTS
        end = self.offset + size
        page = chosen[self.offset : end]
        if self.status_equals is not None and status_after_page:
            page = [j for j in page if status(j) == self.status_equals]
        return page, encode_token(end) if end < len(chosen) else None


def _without_none(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if v is not None}


def _throttle() -> None:
    runtime = runtime_or_none()
    if runtime is None:
        return
    try:
        runtime.sagemaker_quotas.take_list_token()
    except quotas.RateExceeded as exc:
        raise ThrottlingException(str(exc)) from None


def sagemaker_list_processing_jobs(self: Any) -> Any:
    """Replaces moto/sagemaker/responses.py SageMakerResponse.list_processing_jobs (see the module docstring)."""
    from moto.core.responses import ActionResult

    _throttle()
    request = ListRequest(self)
    jobs = list(self.sagemaker_backend.processing_jobs.values())
    page, token = request.page(
        jobs, lambda j: j.processing_job_name, lambda j: j.processing_job_status, status_after_page=False
    )
    summaries = [
        _without_none(
            {
                "ProcessingJobName": job.processing_job_name,
                "ProcessingJobArn": job.arn,
                "CreationTime": job.creation_time,
                "ProcessingEndTime": job.processing_end_time,
                "LastModifiedTime": job.last_modified_time,
                "ProcessingJobStatus": job.processing_job_status,
                "FailureReason": getattr(job, "failure_reason", None),
                "ExitMessage": getattr(job, "exit_message", None),
            }
        )
        for job in page
    ]
    return ActionResult(_without_none({"ProcessingJobSummaries": summaries, "NextToken": token}))


def sagemaker_list_training_jobs(self: Any) -> Any:
    """Replaces moto/sagemaker/responses.py SageMakerResponse.list_training_jobs (see the module docstring)."""
    from moto.core.responses import ActionResult

    _throttle()
    request = ListRequest(self)
    jobs = list(self.sagemaker_backend.training_jobs.values())
    page, token = request.page(
        jobs, lambda j: j.training_job_name, lambda j: j.training_job_status, status_after_page=True
    )
    summaries = [
        _without_none(
            {
                "TrainingJobName": job.training_job_name,
                "TrainingJobArn": job.arn,
                "CreationTime": job.creation_time,
                "TrainingEndTime": job.training_end_time,
                "LastModifiedTime": job.last_modified_time,
                "TrainingJobStatus": job.training_job_status,
                "SecondaryStatus": job.secondary_status,
            }
        )
        for job in page
    ]
    return ActionResult(_without_none({"TrainingJobSummaries": summaries, "NextToken": token}))


def patches() -> list[Patch]:
    from moto.sagemaker.responses import SageMakerResponse

    return [
        replace(SageMakerResponse, "list_processing_jobs", sagemaker_list_processing_jobs),
        replace(SageMakerResponse, "list_training_jobs", sagemaker_list_training_jobs),
    ]
