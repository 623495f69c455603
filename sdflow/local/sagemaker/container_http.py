"""POST /invocations to a serve container the way SageMaker's front end does: the front end holds the
whole request body (up to InvokeEndpoint's 6 MB) before the container sees it, and whatever the
container answers is the answer, even one it sends before reading the body.

A container may refuse a body by its Content-Length alone (sdflow's serve answers 413 past its
64 KiB limit) and close the connection. urllib sends the whole body first: past the socket
buffers the send fails with "connection reset by peer" and the container's 413 was never read, so
the local cloud answered ServiceUnavailable 503. On SageMaker the caller gets ModelError 424 with
OriginalStatusCode 413 ("Received client error (413) from primary", as quoted in
huggingface/text-embeddings-inference#433 for a container that refused a large body). Here the
body goes out in chunks, and between chunks the socket is checked for an answer; an answer that
came before a send failed is still read."""

from __future__ import annotations

import http.client
import select
from collections.abc import Callable
from dataclasses import dataclass

CHUNK_BYTES = 64 * 1024
# Where SageMaker runs the serve container: its own host. Here, this machine's loopback.
CONTAINER_HOST = "127.0.0.1"

Connect = Callable[[int, float], http.client.HTTPConnection]


@dataclass(frozen=True)
class ContainerAnswer:
    status: int
    content_type: str
    body: bytes


def connect(port: int, timeout_s: float) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(CONTAINER_HOST, port, timeout=timeout_s)


def post_invocation(
    port: int, body: bytes, headers: dict[str, str], timeout_s: float, connect: Connect = connect
) -> ContainerAnswer:
    """The container's answer to POST /invocations. Raises TimeoutError when it does not answer
    within `timeout_s`, OSError or http.client.HTTPException when it cannot be reached or closes
    the connection without an answer."""
    connection = connect(port, timeout_s)
    try:
        connection.putrequest("POST", "/invocations", skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders()
        _send_until_answered(connection, body)
        response = connection.getresponse()
        return ContainerAnswer(
            response.status, response.getheader("Content-Type") or "application/octet-stream", response.read()
        )
    finally:
        connection.close()


def _send_until_answered(connection: http.client.HTTPConnection, body: bytes) -> None:
    """Send the body, stopping early when the container has answered (or closed) already."""
    sock = connection.sock
    if sock is None:
        raise ConnectionError("the connection to the container closed before the request was sent")
    view = memoryview(body)
    sent = 0
    try:
        while sent < len(body):
            answered, _, _ = select.select([sock], [], [], 0)
            if answered:
                return
            sent += sock.send(view[sent : sent + CHUNK_BYTES])
    except (BrokenPipeError, ConnectionResetError):
        return  # the container closed its side: its answer, if it sent one, is read next
