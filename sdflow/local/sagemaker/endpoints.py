"""Endpoints of the local SageMaker: each endpoint config's model served by the image's `serve`
entrypoint on a free port of 127.0.0.1, in `workdir/endpoints/<endpoint>/<endpoint config>/`
(the model artifact extracted to `opt_ml/model`). CreateEndpoint starts the first process; a
blue/green UpdateEndpoint starts the new one beside the old, which keeps serving until the new
one answers /ping (else the update rolls back); InvokeEndpoint posts to the process serving now.

`EndpointHosting` is the endpoint half of LocalSageMaker (sdflow/local/sagemaker/engine.py), which owns
the state and the helpers declared here."""

from __future__ import annotations

import http.client
import logging
import shutil
import tarfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow.local.runtime import current_clock
from sdflow.local.sagemaker.container import ContainerProcess, terminate
from sdflow.local.sagemaker.container_http import post_invocation
from sdflow.local.sagemaker.host import (
    ContainerError,
    DeploymentFailed,
    EndpointNotFound,
    EndpointUnreachable,
    JobSetupError,
    LocalSageMakerError,
    LocalSageMakerHalf,
    S3Transfer,
    clip_reason,
    free_port,
)

LOG = logging.getLogger("sdflow.local.sagemaker")

# Where SageMaker puts a model's AdditionalModelDataSources, below /opt/ml (one folder per ChannelName),
# and the channel and variable of a LoRA model's base (sdflow_common.model_registry, which the local
# cloud does not import: it serves any model, not only the pipeline's).
ADDITIONAL_SOURCES_DIR = "additional-model-data-sources"
BASE_MODEL_CHANNEL = "base_model"
BASE_MODEL_DIR_ENV = "SDFLOW_BASE_MODEL_DIR"

# InvokeEndpoint: "A customer's model containers must respond to requests within 60 seconds."
# Past it SageMaker answers ModelError with OriginalStatusCode 0 and this message (as quoted in
# aws/amazon-sagemaker-examples#799 and aws-samples/host-yolov8-on-sagemaker-endpoint#21).
INVOKE_TIMEOUT_S = 60.0
INVOCATION_TIMED_OUT = (
    b"Your invocation timed out while waiting for a response from container primary. Review the latency "
    b"metrics for each container in Amazon CloudWatch, resolve the issue, and try again."
)


@dataclass
class Deployment:
    config_name: str
    folder: Path
    port: int
    process: ContainerProcess


@dataclass
class EndpointState:
    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)  # one deployment at a time
    current: Deployment | None = None
    status: str = "Creating"
    threads: list[threading.Thread] = field(default_factory=list)
    deleted: threading.Event = field(default_factory=threading.Event)  # DeleteEndpoint came


class EndpointHosting(LocalSageMakerHalf):
    """Deploy, update, invoke and delete endpoints; LocalSageMaker provides the state and helpers."""

    workdir: Path
    region: str
    ping_timeout_s: float
    invoke_timeout_s: float
    _endpoints: dict[str, EndpointState]
    _wall: dict[str, float]
    _closing: threading.Event
    _http: urllib.request.OpenerDirector

    def _s3_for(self, role_arn: str | None) -> S3Transfer:
        raise NotImplementedError

    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None:
        """CreateEndpoint (no serve process yet) or a blue/green UpdateEndpoint: the new process
        must answer /ping before traffic moves to it; if it never does, the old one keeps serving."""
        if self._closing.is_set():
            raise LocalSageMakerError("the local SageMaker is shut down")
        config_name = endpoint_config.get("EndpointConfigName")
        if not config_name:
            raise LocalSageMakerError("endpoint_config needs EndpointConfigName")
        with self._lock:
            endpoint = self._endpoints.setdefault(endpoint_name, EndpointState(endpoint_name))
            thread = threading.Thread(
                target=self._deploy_busy,
                args=(endpoint, config_name, model),
                name=f"sdflow-endpoint-{endpoint_name}",
                daemon=True,
            )
            endpoint.threads = [t for t in endpoint.threads if t.is_alive()] + [thread]
        thread.start()

    def _deploy_busy(self, endpoint: EndpointState, config_name: str, model: dict[str, Any]) -> None:
        # Starting a serve process and waiting for /ping is work: the clock runs at real speed.
        with current_clock().busy():
            self._deploy(endpoint, config_name, model)

    def _deploy(self, endpoint: EndpointState, config_name: str, model: dict[str, Any]) -> None:
        name = endpoint.name
        with endpoint.lock:
            old = endpoint.current
            if old is not None and not old.process.alive():
                old = None  # a dead process is nothing to roll back to
            status = "Updating" if old is not None else "Creating"
            endpoint.status = status
            self._report("endpoint", name, status, {"EndpointConfigName": old.config_name if old else config_name})
            try:
                deployment = self._start_serving(name, config_name, model, endpoint.deleted)
            except Exception as exc:
                if endpoint.deleted.is_set():
                    self._drop_deleted(endpoint, [old.process] if old else [])
                    return
                reason = clip_reason(
                    str(exc) if isinstance(exc, LocalSageMakerError) else f"{type(exc).__name__}: {exc}"
                )
                if old is not None:
                    endpoint.status = "RollingBack"
                    self._report(
                        "endpoint",
                        name,
                        "RollingBack",
                        {"EndpointConfigName": old.config_name, "FailureReason": reason},
                    )
                    endpoint.status = "InService"
                    self._report(
                        "endpoint", name, "InService", {"EndpointConfigName": old.config_name, "FailureReason": reason}
                    )
                else:
                    with self._lock:
                        endpoint.current = None
                    endpoint.status = "Failed"
                    self._report(
                        "endpoint", name, "Failed", {"EndpointConfigName": config_name, "FailureReason": reason}
                    )
                return
            if endpoint.deleted.is_set():
                self._drop_deleted(endpoint, [deployment.process] + ([old.process] if old else []))
                return
            with self._lock:
                endpoint.current = deployment  # traffic moves here: invoke reads `current`
            if old is not None:
                terminate([old.process], self.stop_grace_s)
            endpoint.status = "InService"
            self._report("endpoint", name, "InService", {"EndpointConfigName": config_name})

    def _drop_deleted(self, endpoint: EndpointState, processes: list[ContainerProcess]) -> None:
        """A deployment that ends after DeleteEndpoint: nothing of it keeps running."""
        terminate(processes, self.stop_grace_s)
        with self._lock:
            endpoint.current = None
        LOG.info("endpoint %s was deleted while %s; its processes are stopped", endpoint.name, endpoint.status)

    def _start_serving(
        self, name: str, config_name: str, model: dict[str, Any], cancelled: threading.Event | None = None
    ) -> Deployment:
        container = model.get("PrimaryContainer") or (model.get("Containers") or [None])[0]
        if not container:
            raise DeploymentFailed(f"model {model.get('ModelName')} has no PrimaryContainer")
        own_model = container.get("ModelDataUrl") or container.get("ModelDataSource")
        if container.get("ModelPackageName") and not own_model:
            container = self._model_package_container(name, model, container)
        folder = self.workdir / "endpoints" / name / config_name
        if folder.exists():
            shutil.rmtree(folder)
        opt_ml = folder / "opt_ml"
        model_dir = opt_ml / "model"
        model_dir.mkdir(parents=True)
        try:
            self._download_model(container, model_dir, folder, self._s3_for(model.get("ExecutionRoleArn")))
        except (JobSetupError, tarfile.TarError) as exc:
            raise DeploymentFailed(f"model artifact of {model.get('ModelName')}: {exc}") from None
        channels = self._download_additional_sources(container, opt_ml, model)
        port = free_port()
        fixed = {"SAGEMAKER_BIND_TO_PORT": str(port), "SDFLOW_SERVE_HOST": "127.0.0.1"}
        if BASE_MODEL_CHANNEL in channels:
            # The container reads the base model where SageMaker puts the channel; here, in this deployment's
            # own opt_ml folder (the /opt/ml path the package's Environment names does not exist on this host).
            fixed[BASE_MODEL_DIR_ENV] = str(channels[BASE_MODEL_CHANNEL])
        try:
            python = self.python_for(container.get("Image"))  # the model's image: its backend's stack
        except JobSetupError as exc:
            raise DeploymentFailed(f"model {model.get('ModelName')}: {exc}") from None
        env = self._environment(opt_ml, container.get("Environment"), fixed, model.get("ExecutionRoleArn"), python)
        script = self._entrypoint("serve", "serve entrypoint")
        process = ContainerProcess(f"{name}/{config_name}", [python, str(script)], env, folder, folder / "serve.log")
        deployment = Deployment(config_name, folder, port, process)
        try:
            self._wait_healthy(deployment, cancelled)
        except BaseException:
            terminate([process], self.stop_grace_s)
            raise
        with self._lock:
            self._wall[config_name] = process.wall_s()
        return deployment

    def _download_model(self, container: dict[str, Any], model_dir: Path, folder: Path, transfer: S3Transfer) -> None:
        """The container's model into `opt_ml/model`, as SageMaker fills /opt/ml/model: ModelDataSource's
        S3DataSource by S3ModelDataSource's rules (an S3Prefix's objects at their key minus the prefix; an
        S3Object under its key's last part, untarred when CompressionType is Gzip), else ModelDataUrl's
        model.tar.gz untarred (a URI ending with "/" is read as a prefix)."""
        data = (container.get("ModelDataSource") or {}).get("S3DataSource")
        if data:
            field_name = "PrimaryContainer.ModelDataSource.S3DataSource.S3Uri"
            if data.get("S3DataType") == "S3Prefix":
                transfer.download_prefix(str(data.get("S3Uri", "")), model_dir, field_name)
            else:
                self._download_object(transfer, data, model_dir, field_name)
            return
        url = container.get("ModelDataUrl")
        if not url:
            raise JobSetupError("the model's PrimaryContainer.ModelDataSource or ModelDataUrl is required locally")
        if url.endswith("/"):
            transfer.download_prefix(url, model_dir, "PrimaryContainer.ModelDataUrl")
            return
        archive = folder / "model.tar.gz"
        transfer.download_file(url, archive, "PrimaryContainer.ModelDataUrl")
        with tarfile.open(archive) as tar:
            tar.extractall(model_dir, filter="data")
        archive.unlink()

    def _download_additional_sources(
        self, container: dict[str, Any], opt_ml: Path, model: dict[str, Any]
    ) -> dict[str, Path]:
        """AdditionalModelDataSources, each to `opt_ml/additional-model-data-sources/<ChannelName>/`, where
        SageMaker puts them in the container (/opt/ml/additional-model-data-sources/<channel>/; see
        sdflow_common.model_registry BASE_MODEL_CHANNEL). An S3Prefix keeps the paths below the prefix; an
        S3Object lands under its key's last part, or is unpacked when CompressionType is Gzip (S3ModelDataSource,
        SageMaker API Reference). A source that cannot be read fails the deployment, as on SageMaker."""
        channels: dict[str, Path] = {}
        for index, source in enumerate(container.get("AdditionalModelDataSources") or [], start=1):
            name = str(source.get("ChannelName", ""))
            data = source.get("S3DataSource") or {}
            field_name = f"AdditionalModelDataSources.{index}.S3DataSource.S3Uri"
            target = opt_ml / ADDITIONAL_SOURCES_DIR / name
            transfer = self._s3_for(model.get("ExecutionRoleArn"))
            try:
                if data.get("S3DataType") == "S3Prefix":
                    transfer.download_prefix(str(data.get("S3Uri", "")), target, field_name)
                else:
                    self._download_object(transfer, data, target, field_name)
            except (JobSetupError, tarfile.TarError) as exc:
                raise DeploymentFailed(f"model {model.get('ModelName')}, channel {name}: {exc}") from None
            channels[name] = target
        return channels

    @staticmethod
    def _download_object(transfer: S3Transfer, data: dict[str, Any], target: Path, field_name: str) -> None:
        uri = str(data.get("S3Uri", ""))
        archive = target / uri.rstrip("/").rsplit("/", 1)[-1]
        transfer.download_file(uri, archive, field_name)
        if data.get("CompressionType") == "Gzip":
            with tarfile.open(archive) as tar:
                tar.extractall(target, filter="data")
            archive.unlink()

    def _model_package_container(self, name: str, model: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
        """A model may name a model package instead of an image and artifact (CreateModel's
        ModelPackageName): serve the package's container, read from the local cloud's registry when the
        endpoint deploys. AWS documents that a version must be Approved to be deployed, not which call
        checks it; checking here lets the local cloud accept CreateModel and fail the deployment."""
        from sdflow.local.sagemaker.registry import ModelPackageUnusable, serving_container

        try:
            return serving_container(container, name, self.region)
        except ModelPackageUnusable as exc:
            raise DeploymentFailed(f"model {model.get('ModelName')}: {exc}") from None

    def _wait_healthy(self, deployment: Deployment, cancelled: threading.Event | None = None) -> None:
        url = f"http://127.0.0.1:{deployment.port}/ping"
        deadline = time.monotonic() + self.ping_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._closing.is_set():
                raise DeploymentFailed("the local SageMaker is shutting down")
            if cancelled is not None and cancelled.is_set():
                raise DeploymentFailed("the endpoint was deleted while it was being deployed")
            code = deployment.process.poll()
            if code is not None:
                deployment.process.finish_log()
                raise DeploymentFailed(
                    f"serve exited with status {code} before /ping answered 200; last log lines:\n"
                    + deployment.process.tail_text()[-700:]
                )
            try:
                with self._http.open(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"{exc.code} {exc.read()[:500].decode('utf-8', errors='replace')}"
                # 503 means "still loading, ask again"; serve answers 500 only when the model can
                # never load, so waiting out ping_timeout_s would only delay the same failure.
                if exc.code == 500:
                    raise DeploymentFailed(
                        f"serve answered GET /ping with {last}; see {deployment.process.log_path}"
                    ) from None
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise DeploymentFailed(
            f"serve did not answer GET /ping with 200 within {self.ping_timeout_s:g} s (last: {last}); "
            f"see {deployment.process.log_path}"
        )

    def _current(self, endpoint_name: str) -> Deployment:
        with self._lock:
            endpoint = self._endpoints.get(endpoint_name)
            deployment = endpoint.current if endpoint else None
        if deployment is None or not deployment.process.alive():
            raise EndpointNotFound(f"endpoint {endpoint_name} has no serving process (not InService)")
        return deployment

    def endpoint_url(self, endpoint_name: str) -> str | None:
        try:
            return f"http://127.0.0.1:{self._current(endpoint_name).port}"
        except EndpointNotFound:
            return None

    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]:
        """POST /invocations of the process now serving, as SageMaker's front end posts it
        (sdflow/local/sagemaker/container_http.py); returns (body, Content-Type).
        Raises ContainerError for an error status or no answer within invoke_timeout_s (status 0, as
        SageMaker reports a timeout), EndpointNotFound, EndpointUnreachable."""
        deployment = self._current(endpoint_name)
        headers = {}
        if content_type:
            headers["Content-Type"] = content_type
        if accept:
            headers["Accept"] = accept
        try:
            answer = post_invocation(deployment.port, body, headers, self.invoke_timeout_s)
        except TimeoutError:
            raise ContainerError(endpoint_name, 0, INVOCATION_TIMED_OUT, "text/plain") from None
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointUnreachable(f"endpoint {endpoint_name} did not answer: {exc}") from None
        if answer.status >= 400:
            raise ContainerError(endpoint_name, answer.status, answer.body, answer.content_type)
        return answer.body, answer.content_type

    def delete_endpoint(self, endpoint_name: str) -> None:
        """Stop the endpoint's serve process (DeleteEndpoint); unknown names are ignored. Returns at
        once: a deployment in progress (Creating / Updating) sees `deleted` and stops its own
        processes, old and new, when it ends."""
        with self._lock:
            endpoint = self._endpoints.pop(endpoint_name, None)
        if endpoint is None:
            return
        endpoint.deleted.set()
        if not endpoint.lock.acquire(blocking=False):
            return
        try:
            if endpoint.current is not None:
                terminate([endpoint.current.process], self.stop_grace_s)
                endpoint.current = None
        finally:
            endpoint.lock.release()
