"""The errors of a request to a worker, shared by the run's side of the isolation (client, remote)."""
from __future__ import annotations


class KernelFailure(RuntimeError):
    """A request to a worker that ended without an answer, with an error raised in the worker, or with an answer
    that is not what the request asks for; the message is the error row's (it names the backend and the case)."""


class ReplyError(KernelFailure):
    """A worker's answer that is not what its request asks for (a core returning something other than arrays, a
    trace with tensors no golden of its case holds, a timing of the wrong length)."""


class RaisedInWorker(KernelFailure):
    """An exception the backend's code raised in its worker: `type_name` is its class's name there and `text` its
    message (the check of a core's signature reads a TypeError so)."""

    def __init__(self, message: str, type_name: str, text: str):
        super().__init__(message)
        self.type_name, self.text = type_name, text
