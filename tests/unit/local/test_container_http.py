"""POST /invocations as SageMaker's front end sends it: the container's answer is read even when it
answers before reading the body (over a socket pair: unit tests open no network socket)."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from sdflow.local.sagemaker.container_http import Connect, post_invocation
from sdflow.local.sagemaker.invoke import BODY_LIMIT_BYTES

Serve = Callable[[socket.socket], None]
Start = Callable[[Serve], Connect]


class PairConnection(http.client.HTTPConnection):
    """An HTTP connection over one end of a socket pair (the container holds the other end)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        super().__init__("container", timeout=timeout)
        self._pair_end = sock

    def connect(self) -> None:
        self._pair_end.settimeout(self.timeout)
        self.sock = self._pair_end


def _read_head(sock: socket.socket) -> tuple[bytes, int]:
    """The request's head, and its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + b"\r\n\r\n" + rest, length


def _answer(sock: socket.socket, status: str, body: bytes) -> None:
    fields = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
    sock.sendall(f"HTTP/1.1 {status}\r\n{fields}\r\n\r\n".encode() + body)


@pytest.fixture
def container() -> Iterator[Start]:
    """Runs `serve` on the container's end of a socket pair; returns the connect function to it."""
    threads: list[threading.Thread] = []

    def start(serve: Serve) -> Connect:
        ours, theirs = socket.socketpair()

        def run() -> None:
            with theirs:
                serve(theirs)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return lambda _port, timeout_s: PairConnection(ours, timeout_s)

    yield start
    for thread in threads:
        thread.join(5)


def test_post_invocation_container_refusing_before_reading_body_answer_is_read(container: Start) -> None:
    refusal = b'{"error":"body is 6291456 bytes; the limit is 65536"}'
    read: list[int] = []

    def refuse_by_length(sock: socket.socket) -> None:
        head, _length = _read_head(sock)
        read.append(len(head))
        _answer(sock, "413 Request Entity Too Large", refusal)  # then closes, the body unread

    connect = container(refuse_by_length)
    answer = post_invocation(9, b"x" * BODY_LIMIT_BYTES, {"Content-Type": "application/json"}, 10.0, connect)
    assert (answer.status, answer.content_type, answer.body) == (413, "application/json", refusal)
    assert read[0] < BODY_LIMIT_BYTES, "the container answered from the head alone"


def test_post_invocation_container_reading_whole_body_answers_200(container: Start) -> None:
    def echo_length(sock: socket.socket) -> None:
        head, length = _read_head(sock)
        got = len(head.split(b"\r\n\r\n", 1)[1])
        while got < length:
            got += len(sock.recv(65536))
        _answer(sock, "200 OK", str(got).encode())

    connect = container(echo_length)
    answer = post_invocation(9, b"y" * 1_000_000, {}, 10.0, connect)
    assert (answer.status, answer.body) == (200, b"1000000")


def test_post_invocation_silent_container_times_out(container: Start) -> None:
    done = threading.Event()

    def silent(sock: socket.socket) -> None:
        _read_head(sock)
        done.wait(5)

    connect = container(silent)
    try:
        with pytest.raises(TimeoutError):
            post_invocation(9, b"{}", {}, 0.3, connect)
    finally:
        done.set()


def test_post_invocation_container_closing_without_answer_raises(container: Start) -> None:
    connect = container(lambda sock: None)  # closes at once
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        post_invocation(9, b"{}", {}, 5.0, connect)
