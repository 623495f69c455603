"""Where the CLI starts the run console, and where notifications link a run."""

from __future__ import annotations

from sdflow import cli
from sdflow_common.notify import console_link

ARN = "arn:aws:states:us-east-1:123456789012:execution:sdflow-local-pipeline:demo-0123456789abcdef"


def test_cli_local_up_console_on_fixed_port_unless_turned_off() -> None:
    assert cli.parse_args(["local", "up"]).console_port == cli.DEFAULT_CONSOLE_PORT
    assert cli.parse_args(["local", "up", "--console-port", "9000"]).console_port == 9000
    assert cli.parse_args(["local", "up", "--no-console"]).console_port is None


def test_cli_demo_console_on_any_free_port_by_default() -> None:
    assert cli.parse_args(["demo"]).console_port == 0
    assert cli.parse_args(["demo", "--no-console"]).console_port is None


def test_cli_console_port_given_or_none_needs_no_socket() -> None:
    """Port 0 binds a socket to find a free port (the e2e tests cover it); the rest is plain."""
    assert cli.console_port_for(None) is None
    assert cli.console_port_for(8123) == 8123
    assert cli.console_url(8123) == "http://127.0.0.1:8123/"


def test_console_link_local_console_url_points_at_the_run_page() -> None:
    assert console_link(ARN, "http://127.0.0.1:8566/") == "http://127.0.0.1:8566/#/runs/demo-0123456789abcdef"


def test_console_link_without_console_url_points_at_the_aws_console() -> None:
    link = console_link(ARN)

    assert link.startswith("https://us-east-1.console.aws.amazon.com/states/home?region=us-east-1")
    assert link.endswith(ARN)
