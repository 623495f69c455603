"""Named errors. Their class names are the `Error` values Step Functions' Retry/Catch match on,
and the names users see in failure notifications, so renaming one is a breaking change."""


class SdflowError(Exception):
    """Base class; never raised itself."""


class InvalidRunDocument(SdflowError):
    """The run document (manifest or execution input) failed validation."""


class DatasetNotFound(SdflowError):
    """The dataset prefix or a listed parquet object does not exist or is not readable."""


class NoUsableShards(SdflowError):
    """Every shard failed, or more failed than the run tolerates."""


class TokenConflict(SdflowError):
    """A resource name is already bound to a different task token (another run holds it)."""


class EndpointBusy(SdflowError):
    """The endpoint is being created or updated by someone else; retry later."""


class DownloadJobFailed(SdflowError):
    """A SageMaker processing job (one shard download) ended Failed or Stopped."""


class TrainingJobFailed(SdflowError):
    """The SageMaker training job ended Failed or Stopped."""


class TrainingCapacityUnavailable(SdflowError):
    """The training job failed because SageMaker could not provision its instances
    (FailureReason "CapacityError: Unable to provision requested ML compute capacity…").
    SageMaker's RetryStrategy does not retry this, so the state retries with a new job, slowly."""


class JobNameTaken(SdflowError):
    """A new task's job name exists already and belongs to another run (its `sdflow:run` tag
    differs): the job is not adopted, since its results are not this run's."""


class RunEnded(SdflowError):
    """The run's execution stopped (or failed, or timed out) while a starter was creating its
    job; the starter stopped the job it had just created so that nothing runs on unobserved."""


class EndpointDeployFailed(SdflowError):
    """The endpoint create/update ended Failed, or the update was rolled back."""


class SageMakerThrottled(SdflowError):
    """SageMaker answered ThrottlingException / 'Rate exceeded' / capacity errors; safe to retry soon."""


class SageMakerQuotaExceeded(SdflowError):
    """SageMaker answered ResourceLimitExceeded: the account's instance quota is in use by other
    jobs. It frees only when they end (minutes to hours), so the state retries it slowly and long."""


class ReconcileIncomplete(SdflowError):
    """The reconciler could not check or resolve some task-token claims (details in the message)."""


class EvaluationJobFailed(SdflowError):
    """The evaluation processing job (the base and the trained model's metrics) ended Failed or Stopped,
    or wrote no usable evaluation.json."""


class DedupJobFailed(SdflowError):
    """The dedup processing job (Find duplicates: the duplicates across every shard) ended Failed or Stopped,
    or could not be started."""


class QualityGateFailed(SdflowError):
    """The trained model failed a check of the run's quality gate (`evaluation.gate`, or
    `evaluation.min_prompt_adherence`): it was registered as Rejected and not deployed; the endpoint
    keeps serving its current model."""


class ModelRejected(SdflowError):
    """A person rejected the model package the run waited on (manual approval): nothing is deployed."""
