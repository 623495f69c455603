"""`sdflow`: run the pipeline locally, start runs, watch them, call the endpoint.

    sdflow local up                  the local cloud, in the foreground
    sdflow run MANIFEST [--api]      start a run (upload the manifest, or StartExecution)
    sdflow resume EXECUTION [--manifest NEW.json] [--name NAME]
                                     a new run reusing what EXECUTION finished (docs/run-document.md)
    sdflow plan MANIFEST [--name NAME] [--json]
                                     what Validate run would decide, starting nothing (exit 0 would start, 2 refused)
    sdflow status EXECUTION          where a run is
    sdflow watch [EXECUTION]         live progress until the run ends
    sdflow invoke ENDPOINT PROMPT -o out.png
    sdflow console [--port N]        the run console in the browser (http://127.0.0.1:8566/)
    sdflow demo                      everything above, on generated data and a tiny model
    sdflow demo --lora               the same, training a LoRA adapter (make demo-lora)

`local up` and `demo` start the console beside the local cloud and print its URL.
Every command but `local up` and `demo` talks to AWS APIs only, so with --endpoint-url
omitted and real credentials they work against AWS too."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from sdflow import progress as progress_mod
from sdflow.console.beside import console_beside, console_port_for, console_url
from sdflow.endpoints import invoke
from sdflow.errors import CliError
from sdflow.runs import resolve_execution, start_resume, start_run
from sdflow.session import DEFAULT_WORKDIR, Session, remove_state, write_state
from sdflow.stopping import StopRequested, stop_on_signals
from sdflow.watch import watch

__all__ = ["StopRequested", "invoke", "main", "parse_args", "start_run", "stop_on_signals", "watch"]


def _time_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--time-scale {text!r} is not a number; use e.g. 60") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"--time-scale {text} is out of range: use 1 (real time) to 100000")
    return value


def cmd_local_up(args: argparse.Namespace) -> int:
    from sdflow.local.cloud import LocalCloud

    args.workdir.mkdir(parents=True, exist_ok=True)
    console_port = console_port_for(args.console_port)
    parameters = {"ConsoleUrl": console_url(console_port)} if console_port else {}
    try:
        with (
            stop_on_signals(),
            LocalCloud(args.workdir, port=args.port, parameters=parameters, time_scale=args.time_scale) as cloud,
            console_beside(cloud, console_port) as console,
        ):
            write_state(args.workdir, cloud)
            print(f"sdflow local cloud on {cloud.endpoint_url}  (work folder {args.workdir})")
            if args.time_scale != 1:
                print(
                    f"Time runs {args.time_scale:g}x faster while nothing works (retries, waits, schedules); "
                    "Lambda invocations and jobs keep their real length."
                )
            if console is not None:
                print(f"Run console: {console.url}")
            print("Use it from another shell with the AWS CLI or boto3:")
            for key, value in cloud.cli_env().items():
                print(f"  export {key}={value}")
            for key, value in cloud.outputs.items():
                print(f"  {key}: {value}")
            print("Ctrl-C stops it (and every job and endpoint it started).", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except (KeyboardInterrupt, StopRequested) as stop:
                # Stopping is this command's normal end; LocalCloud.__exit__ stops jobs, endpoints, workers.
                print(f"stopping ({stop})", flush=True)
    finally:
        remove_state(args.workdir)
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from sdflow.console.server import ConsoleServer

    session = Session.from_args(args)
    try:
        server = ConsoleServer(session.console_config(), port=args.port).start()
    except OSError as exc:
        raise CliError(str(exc)) from None
    where = session.endpoint_url or f"AWS ({session.region or 'default region'})"
    print(f"sdflow console on {server.url}  (reading {where}); Ctrl-C stops it", flush=True)
    try:
        with stop_on_signals():
            while True:
                time.sleep(3600)
    except (KeyboardInterrupt, StopRequested):
        pass
    finally:
        server.stop()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    session = Session.from_args(args)
    # --name is the execution's name, which only StartExecution takes.
    arn = start_run(session, args.manifest, api=args.api, name=args.name if args.api else None)
    print(arn)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    session = Session.from_args(args)
    arn = start_resume(session, args.execution, manifest=args.manifest, name=args.name)
    print(arn)
    print(
        "Validate run reuses every shard whose parquet object and download options are unchanged and whose "
        "_SUCCESS still exists, and the trained model when nothing that shapes it changed; "
        f"`sdflow watch {shlex.quote(arn.rsplit(':', 1)[-1])}` follows it.",
        file=sys.stderr,
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from sdflow.plan import cmd_plan as plan

    session = Session.from_args(args)
    return plan(session, args.manifest, name=args.name, as_json=args.json, stack_name=args.stack_name)


def cmd_status(args: argparse.Namespace) -> int:
    session = Session.from_args(args)
    bucket = session.data_bucket()
    arn = resolve_execution(session, args.execution)
    snap = progress_mod.snapshot(session.client("stepfunctions"), session.client("s3"), bucket, arn, session.workdir)
    print("\n".join(progress_mod.render_lines(snap)))
    return 0 if snap.status in {"RUNNING", "SUCCEEDED"} else 1


def cmd_watch(args: argparse.Namespace) -> int:
    session = Session.from_args(args)
    session.data_bucket()  # fail before any call when the stack is unknown
    snap = watch(session, resolve_execution(session, args.execution))
    return 0 if snap.status == "SUCCEEDED" else 1


def cmd_invoke(args: argparse.Namespace) -> int:
    session = Session.from_args(args)
    path = invoke(
        session, args.endpoint, args.prompt, args.output,
        num_inference_steps=args.steps, seed=args.seed, width=args.width, height=args.height,
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sdflow.demo import lora_demo_options, run_demo

    try:
        with stop_on_signals():
            options = lora_demo_options() if args.lora else None
            output = args.output or Path("sdflow-demo-lora.png" if args.lora else "sdflow-demo.png")
            return run_demo(
                args.workdir, output=output, keep_running=args.keep_running, options=options,
                console_port=args.console_port,
            )  # fmt: skip
    finally:
        remove_state(args.workdir)


DEFAULT_CONSOLE_PORT = 8566


def add_console_flags(parser: argparse.ArgumentParser, default: int = DEFAULT_CONSOLE_PORT) -> None:
    parser.add_argument(
        "--console-port", type=int, default=default,
        help=f"the run console's port on 127.0.0.1 (default {default}; 0: any free port)",
    )  # fmt: skip
    parser.add_argument(
        "--no-console", dest="console_port", action="store_const", const=None, help="do not start the run console"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sdflow", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="local runtime work folder")
    parser.add_argument("--endpoint-url", default=None, help="AWS API endpoint (default: the local cloud's)")
    parser.add_argument("--bucket", default=None, help="the stack's data bucket (default: from the local cloud)")
    parser.add_argument("--state-machine-arn", default=None, help="the pipeline (default: from the local cloud)")
    commands = parser.add_subparsers(dest="command", required=True)

    local = commands.add_parser("local", help="the local cloud").add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start the local cloud in the foreground")
    up.add_argument("--port", type=int, default=4566, help="port on 127.0.0.1 (0: any free port)")
    up.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="NAME=N",
        help="a SageMaker instance quota, e.g. 'processing job=8' (every instance type) or "
        "'ml.g5.xlarge for training job usage=1'; repeatable (default: $SDFLOW_LOCAL_QUOTAS, then 4/2/2)",
    )
    up.add_argument(
        "--time-scale",
        type=_time_scale,
        default=1.0,
        metavar="N",
        help="run the cloud's clock N times faster while nothing is working, so Retry backoffs, Wait states, "
        "timeouts and the reconciler's schedule play out in minutes (default 1: real time)",
    )
    add_console_flags(up)
    up.set_defaults(func=cmd_local_up)

    run = commands.add_parser("run", help="start a run from a run document")
    run.add_argument("manifest", type=Path, help="the run document (JSON)")
    run.add_argument("--api", action="store_true", help="StartExecution instead of uploading to manifests/")
    run.add_argument("--name", default=None, help="execution name (with --api)")
    run.set_defaults(func=cmd_run)

    resume = commands.add_parser("resume", help="start a run that reuses what an ended run finished")
    resume.add_argument("execution", help="the earlier execution: name or ARN")
    resume.add_argument("--manifest", type=Path, default=None, help="a changed run document (default: the old input)")
    resume.add_argument("--name", default=None, help="execution name (default: <old name>-resume-<UTC time>)")
    resume.set_defaults(func=cmd_resume)

    plan = commands.add_parser("plan", help="what Validate run would decide for a run document, starting nothing")
    plan.add_argument("manifest", type=Path, help="the run document (JSON)")
    plan.add_argument("--name", default=None, help="execution name (default: the one an upload of MANIFEST gets)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    plan.add_argument("--stack-name", default=None, help="the deployed stack (default: sdflow, or the local cloud's)")
    plan.set_defaults(func=cmd_plan)

    status = commands.add_parser("status", help="where a run is")
    status.add_argument("execution", nargs="?", default=None, help="execution name or ARN (default: the newest)")
    status.set_defaults(func=cmd_status)

    watch_cmd = commands.add_parser("watch", help="follow a run until it ends")
    watch_cmd.add_argument("execution", nargs="?", default=None, help="execution name or ARN (default: the newest)")
    watch_cmd.set_defaults(func=cmd_watch)

    inv = commands.add_parser("invoke", help="generate an image with an endpoint")
    inv.add_argument("endpoint", help="endpoint name")
    inv.add_argument("prompt", help="the text prompt")
    inv.add_argument("-o", "--output", type=Path, default=Path("out.png"), help="PNG file to write")
    inv.add_argument("--steps", type=int, default=None, help="num_inference_steps")
    inv.add_argument("--seed", type=int, default=None, help="seed for a reproducible image")
    inv.add_argument("--width", type=int, default=None, help="image width (multiple of 8)")
    inv.add_argument("--height", type=int, default=None, help="image height (multiple of 8)")
    inv.set_defaults(func=cmd_invoke)

    demo = commands.add_parser("demo", help="the whole pipeline on generated data and a tiny model")
    demo.add_argument(
        "-o", "--output", type=Path, default=None,
        help="image the endpoint makes (default sdflow-demo.png; with --lora sdflow-demo-lora.png)",
    )  # fmt: skip
    demo.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter on the same scenes instead (make demo-lora)"
    )
    demo.add_argument("--keep-running", action="store_true", help="keep the local cloud up after the run")
    add_console_flags(demo, default=0)
    demo.set_defaults(func=cmd_demo)

    console = commands.add_parser("console", help="the run console in the browser, on 127.0.0.1")
    console.add_argument("--port", type=int, default=DEFAULT_CONSOLE_PORT, help="port on 127.0.0.1 (0: any free port)")
    console.set_defaults(func=cmd_console)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"sdflow: {exc}", file=sys.stderr)
        return 2
    except StopRequested as stop:
        print(f"sdflow: stopped by {stop}", file=sys.stderr)
        return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
