"""The local cloud: a moto server on 127.0.0.1 running template.yaml with real handlers.

    with LocalCloud(Path(".work/local")) as cloud:
        boto3.client("s3", endpoint_url=cloud.endpoint_url).upload_file("run.json", cloud.bucket, "manifests/run.json")

What it does on start():
- starts moto's ThreadedMotoServer bound to 127.0.0.1 only, with state-machine execution on and
  the Docker-free Lambda backend (moto's process-wide config), MOTO_PORT set for the Step
  Functions interpreter's own clients;
- installs sdflow.local.patching (patching.PATCH_MODULES: real handlers, EventBridge targets,
  SageMaker jobs, SNS files …);
- deploys template.yaml through sdflow.local.template (SAM -> CloudFormation -> CreateStack);
- creates the LocalSageMaker that runs jobs and endpoints as local processes.

moto's configuration, backends and MOTO_PORT are process-wide, so one process holds at most one
running LocalCloud."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from sdflow.local import moto_data, moto_logging, native_memory, patching, scheduler, sessions, template
from sdflow.local.account import ACCOUNT_ID, REGION
from sdflow.local.clock import Clock
from sdflow.local.faults import Faults
from sdflow.local.lambda_runner import DEFAULT_MAX_WORKERS_PER_FUNCTION, LambdaRunner
from sdflow.local.runtime import Runtime, SageMakerEngine
from sdflow.local.sagemaker import quotas as sagemaker_quotas
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from sdflow.local.sdk_config import CONFIG_ENV, write_sdk_config
from sdflow.local.sdk_config import FILE_NAME as SDK_CONFIG_FILE
from sdflow.local.services import awslambda, sns
from sdflow.local.services.iam import IamEnforcer
from sdflow.local.services.logs import CloudWatchSink
from sdflow.local.stepfunctions import shutdown

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MOTO_CONFIG: dict[str, Any] = {
    "stepfunctions": {"execute_state_machine": True},
    "lambda": {"use_docker": False},
}
CLI_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}

SageMakerFactory = Callable[[Path, str, SageMakerStatusPublisher], SageMakerEngine]


class LocalCloudError(RuntimeError):
    """The local cloud cannot start or is used before start()."""


_running_lock = threading.Lock()
_running: LocalCloud | None = None


def _moto_config() -> dict[str, Any]:
    """moto's process-wide user config (what mock_aws(config=…) and /moto-api/config set)."""
    from moto.core.config import default_user_config

    return cast(dict[str, Any], default_user_config)


def _default_sagemaker(workdir: Path, endpoint_url: str, listener: SageMakerStatusPublisher) -> Any:
    from sdflow.local.sagemaker.engine import LocalSageMaker  # type: ignore[import-not-found, unused-ignore]

    return LocalSageMaker(workdir / "sagemaker", endpoint_url, listener=listener, region=REGION)


class LocalCloud:
    """A moto server with the stack deployed and real handlers behind it; a context manager."""

    def __init__(
        self,
        workdir: Path,
        port: int = 0,
        *,
        template_path: Path | None = None,
        stack_name: str = template.DEFAULT_STACK_NAME,
        parameters: Mapping[str, Any] | None = None,
        sagemaker_factory: SageMakerFactory | None = _default_sagemaker,
        lambda_workers_per_function: int = DEFAULT_MAX_WORKERS_PER_FUNCTION,
        async_retry_delays_s: tuple[float, ...] = (1.0, 2.0),
        enforce_iam: bool = True,
        quotas: Mapping[str, int] | None = None,
        sagemaker_create_rate: tuple[float, int] = (
            sagemaker_quotas.DEFAULT_CREATE_RATE_PER_S,
            sagemaker_quotas.DEFAULT_CREATE_BURST,
        ),
        sagemaker_list_rate: tuple[float, int] = (
            sagemaker_quotas.DEFAULT_LIST_RATE_PER_S,
            sagemaker_quotas.DEFAULT_LIST_BURST,
        ),
        time_scale: float = 1.0,
        clock: Clock | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.requested_port = port
        self.template_path = Path(template_path or template.repository_root() / "template.yaml")
        self.stack_name = stack_name
        self.parameters = dict(parameters or {})
        self.sagemaker_factory = sagemaker_factory
        self.lambda_workers_per_function = lambda_workers_per_function
        self.async_retry_delays_s = async_retry_delays_s
        self.enforce_iam = enforce_iam
        # SageMaker instance quotas (sagemaker/quotas.py): `quotas`, else $SDFLOW_LOCAL_QUOTAS,
        # over small defaults; checked here so a bad override fails before anything starts.
        overrides = (
            quotas
            if quotas is not None
            else sagemaker_quotas.overrides_from_env(os.environ.get(sagemaker_quotas.QUOTAS_ENV))
        )
        self.sagemaker_quotas = sagemaker_quotas.SageMakerQuotas(
            overrides=dict(overrides),
            create_rate_per_s=sagemaker_create_rate[0],
            create_burst=sagemaker_create_rate[1],
            list_rate_per_s=sagemaker_list_rate[0],
            list_burst=sagemaker_list_rate[1],
        )
        # The one clock every waiting part reads (sdflow/local/clock.py): real time, or
        # `time_scale` times faster while nothing is working (tests; `local up --time-scale`).
        self.clock = clock if clock is not None else Clock(scale=time_scale)
        self.sagemaker_quotas.clock = self.clock
        self.schedules: scheduler.ScheduleRunner | None = None
        self.deployment: template.Deployment | None = None
        self.runtime: Runtime | None = None
        self.status_publisher = SageMakerStatusPublisher(ACCOUNT_ID, REGION)
        self._server: Any = None
        self._port: int | None = None
        self._saved_env: dict[str, str | None] = {}
        self._saved_config: dict[str, Any] = {}
        self._moto_logs: moto_logging.Routing | None = None
        self._cloudwatch: CloudWatchSink | None = None
        self._clients: dict[str, Any] = {}  # client(): one per service, for this start's endpoint
        self._clients_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LocalCloud:
        global _running
        with _running_lock:
            if _running is not None:
                raise LocalCloudError(
                    "a LocalCloud is already running in this process (moto's state is process-wide); stop it first"
                )
            _running = self
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from moto.moto_api._internal.models import moto_api_backend
        from moto.server import ThreadedMotoServer

        native_memory.cap_malloc_arenas()  # before the cloud's threads: native_memory says why
        self.workdir.mkdir(parents=True, exist_ok=True)
        # moto's interpreter dumps component reprs on every failure: to a file, one line on the console.
        self._moto_logs = moto_logging.route(self.workdir / "logs" / "moto.log")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one INFO line per request otherwise
        config = _moto_config()
        self._saved_config = {key: config.get(key) for key in MOTO_CONFIG}
        config.update({key: dict(value) for key, value in MOTO_CONFIG.items()})
        moto_api_backend.reset()  # a previous cloud in this process leaves its resources behind

        self._server = ThreadedMotoServer(ip_address=HOST, port=self.requested_port, verbose=False)
        self._server.start()
        self._port = int(self._server.get_host_and_port()[1])
        # The Step Functions interpreter calls http://localhost:$MOTO_PORT for its tasks.
        self._set_env("MOTO_PORT", str(self._port))

        runner = LambdaRunner(
            self.endpoint_url,
            REGION,
            self.workdir / "logs" / "lambda",
            max_workers_per_function=self.lambda_workers_per_function,
            account_id=ACCOUNT_ID,
            # Function output also goes to /aws/lambda/<fn> log groups and EMF lines to CloudWatch metrics.
            output_sink=(cloudwatch := CloudWatchSink(ACCOUNT_ID, REGION)),
            clock=self.clock,
        )
        self._cloudwatch = cloudwatch
        self.runtime = Runtime(
            workdir=self.workdir,
            lambda_runner=runner,
            clock=self.clock,
            async_retry_delays_s=self.async_retry_delays_s,
            sagemaker_quotas=self.sagemaker_quotas,
            # Functions, the state machine and jobs call as their template roles (services/iam.py).
            iam=IamEnforcer(REGION) if self.enforce_iam else None,
        )
        patching.install(self.runtime)
        moto_data.keep_offerings_of(REGION)  # moto has loaded EC2's data by now (the patches import it)
        self.deployment = template.deploy(
            self.template_path,
            self.endpoint_url,
            stack_name=self.stack_name,
            parameters=self.parameters,
            region=REGION,
            account_id=ACCOUNT_ID,
        )
        write_sdk_config(self.workdir, self.deployment.outputs)
        for function in self.deployment.functions.values():
            self.runtime.register_code(function.name, function.code_dir, function.layer_dirs)
        if self.sagemaker_factory is not None:
            self.runtime.sagemaker = self.sagemaker_factory(self.workdir, self.endpoint_url, self.status_publisher)
            # The stack's second image (template parameter AccelerateImageTag) runs in .venv-accelerate locally.
            accelerate_image = self.deployment.outputs.get("AccelerateImageUri")
            if accelerate_image and hasattr(self.runtime.sagemaker, "use_accelerate_image"):
                self.runtime.sagemaker.use_accelerate_image(accelerate_image)
            enforcer = self.runtime.iam
            if enforcer is not None and hasattr(self.runtime.sagemaker, "role_credentials"):
                # SageMaker's own session for a job's role is named "SageMaker".
                credentials = lambda arn: enforcer.credentials_for_role(arn, "SageMaker")  # noqa: E731
                setattr(self.runtime.sagemaker, "role_credentials", credentials)  # noqa: B010
        self.schedules = scheduler.ScheduleRunner(ACCOUNT_ID, REGION, clock=self.clock)
        self.schedules.start()
        log.info("local cloud on %s, stack %s deployed", self.endpoint_url, self.stack_name)

    def stop(self) -> None:
        """Stop jobs, endpoints, workers and the server; restore moto's process-wide settings."""
        global _running
        if self.schedules is not None:
            self.schedules.stop()
        if self.runtime is not None:  # before the clock closes: its waits would end them as timeouts
            shutdown.end_running_executions(self.runtime, ACCOUNT_ID, REGION)
        self.clock.close()
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.stopping = True
            if runtime.sagemaker is not None and hasattr(runtime.sagemaker, "shutdown"):
                with contextlib.suppress(Exception):
                    runtime.sagemaker.shutdown()
            runtime.lambda_concurrency.close()  # events waiting for a reserved slot give up
            if runtime.lambda_runner is not None:
                runtime.lambda_runner.shutdown()
            patching.uninstall()
        if self._cloudwatch is not None:  # after the workers: their last lines are in the buffer
            self._cloudwatch.close()
            self._cloudwatch = None
        if self._server is not None:
            self._server.stop()
            self._server = None
            with self._clients_lock:  # a restarted cloud listens on another port
                self._clients.clear()
            from moto.moto_api._internal.models import moto_api_backend

            moto_api_backend.reset()
        if self._moto_logs is not None:
            self._moto_logs.restore()
            self._moto_logs = None
        if self._saved_config:
            config = _moto_config()
            for key, value in self._saved_config.items():
                if value is None:
                    config.pop(key, None)
                else:
                    config[key] = value
            self._saved_config = {}
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        with _running_lock:
            if _running is self:
                _running = None

    def __enter__(self) -> LocalCloud:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _set_env(self, key: str, value: str) -> None:
        self._saved_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    # ------------------------------------------------------------------ what users need

    @property
    def port(self) -> int:
        if self._port is None:
            raise LocalCloudError("the local cloud is not started; call start() or use it as a context manager")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _deployment(self) -> template.Deployment:
        if self.deployment is None:
            raise LocalCloudError("the stack is not deployed; call start() first")
        return self.deployment

    @property
    def outputs(self) -> dict[str, str]:
        return dict(self._deployment().outputs)

    @property
    def bucket(self) -> str:
        return self.outputs["DataBucketName"]

    @property
    def state_machine_arn(self) -> str:
        return self.outputs["PipelineStateMachineArn"]

    @property
    def topic_arn(self) -> str:
        return self.outputs["NotificationTopicArn"]

    @property
    def topic_name(self) -> str:
        return self.topic_arn.rsplit(":", 1)[-1]

    def cli_env(self) -> dict[str, str]:
        """Environment variables that point the AWS CLI (or boto3) at this cloud."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            **CLI_CREDENTIALS,
            # The SageMaker Python SDK's defaults: this stack's bucket and notebook role (sdk_config.py).
            CONFIG_ENV: str(self.workdir / SDK_CONFIG_FILE),
        }

    def client(self, service: str, **options: Any) -> Any:
        """A boto3 client for this cloud (its own session: nothing from the user's profile);
        `options` go to boto3's client(), e.g. a botocore Config. Without options, one client per
        service while the cloud runs (boto3 clients are safe to share between threads): building
        one parses the service's model afresh, ~0.1 s of CPU for SageMaker, and callers that poll
        (watch, the tests' waits) would pay it on every poll."""
        if options:
            return self._new_client(service, **options)
        with self._clients_lock:
            client = self._clients.get(service)
            if client is None:
                client = self._clients[service] = self._new_client(service)
            return client

    def _new_client(self, service: str, **options: Any) -> Any:
        session = sessions.session(
            aws_access_key_id=CLI_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CLI_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=CLI_CREDENTIALS["AWS_SESSION_TOKEN"],
            region_name=REGION,
        )
        return session.client(service, endpoint_url=self.endpoint_url, **options)  # type: ignore[call-overload]

    def sns_messages(self, topic_name: str | None = None) -> list[dict[str, Any]]:
        """Messages published to a topic (default: the stack's notification topic), oldest first."""
        return sns.read_sns_messages(self.workdir, topic_name or self.topic_name)

    @property
    def faults(self) -> Faults:
        """Fault injection for tests: kill a job or a Lambda worker, crash a handler after a call,
        fail training for capacity, deliver an event twice (sdflow/local/faults.py)."""
        return Faults(self)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no asynchronous Lambda invocation (event delivery) is running."""
        if self.runtime is None:
            return True
        return self.runtime.wait_idle(timeout_s)

    def prewarm(self) -> threading.Thread:
        """Start one worker per function in the background (cold starts off the run's path)."""
        from moto.awslambda.utils import get_backend

        runtime = self.runtime
        if runtime is None or runtime.lambda_runner is None:
            raise LocalCloudError("the local cloud is not started")
        runner = runtime.lambda_runner
        functions = list(get_backend(ACCOUNT_ID, REGION).list_functions())

        def warm() -> None:
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda fn: runner.prewarm(awslambda.function_spec(runtime, fn)), functions))

        thread = threading.Thread(target=warm, name="sdflow-prewarm", daemon=True)
        thread.start()
        return thread

    def function_name(self, logical_id: str) -> str:
        """The deployed name of a template function, e.g. function_name("StartPipelineFunction")."""
        functions = self._deployment().functions
        if logical_id not in functions:
            raise LocalCloudError(f"no function {logical_id} in the template; it has {sorted(functions)}")
        return functions[logical_id].name

    def fire_schedules(self, now: Any = None) -> list[str]:
        """Fire scheduled rules and schedules: those due by `now` (a datetime on the schedules'
        clock), or every enabled one once when `now` is None. Returns the ARNs delivered."""
        if self.schedules is None:
            raise LocalCloudError("the local cloud is not started")
        return self.schedules.fire_all() if now is None else self.schedules.fire_due(now)
