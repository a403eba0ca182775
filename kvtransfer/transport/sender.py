"""The sender state machine, once for every backend: where a sender's state changes.

Why one: fake, nccl/gloo, gRPC and cuda_ipc differ in how bytes move, not in what a call
means, and the contract suite (tests/support/contract.py) holds them all to the same rules,
kept here: layers go in order, inside the header's count, with its shape and dtype (a wrong
call is refused with `protocol` and the request stays open); the first failure wins and
ends the request, also one a backend hears of on its own threads (gRPC's callbacks) or
through its back channel (`_heard`); every later call raises that failure; `finish` after
success returns, after `abort` raises `aborted`; `abort` after the end does nothing.

A backend subclasses `BaseSender` and implements only how bytes move: `_send`, `_finish`,
`_abort`, and where it needs them `_check`, `_heard`, `_end`. Hooks run without the lock
and fail the request by raising TransferError; they never set the state.
"""

from __future__ import annotations

import threading

import torch

from kvtransfer.transport.base import KVSender, TransferError, TransferHeader, TransferState

_OPEN = (TransferState.WAITING, TransferState.TRANSFERRING)


def check_layer(header: TransferHeader, expected_idx: int, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Layer order and range; shapes and dtype match the header."""
    if not 0 <= idx < header.num_layers:
        raise TransferError("protocol", f"layer {idx} sent; the header has layers 0..{header.num_layers - 1}")
    if idx != expected_idx:
        raise TransferError("protocol", f"layer {idx} sent, layer {expected_idx} expected (send in order)")
    want = header.layer_shape()
    for name, t in (("key", k), ("value", v)):
        if tuple(t.shape) != want or t.dtype != header.dtype:
            raise TransferError("protocol", f"layer {idx} {name} is {tuple(t.shape)} {t.dtype}, "
                                f"header says {want} {header.dtype}")


def _again(err: TransferError) -> TransferError:
    """The same failure as a new exception: the stored one stays free of tracebacks (and of the frames' tensors)."""
    again = type(err).__new__(type(err), *err.args)
    again.cause = err.cause
    return again


class BaseSender(KVSender):
    def __init__(self, header: TransferHeader):
        self.header = header
        self._state = TransferState.WAITING
        self._next = 0  # the layer send_layer takes next
        self._error: TransferError | None = None  # the first failure (a copy without traceback)
        self._aborted: str | None = None  # abort's reason
        self._lock = threading.Lock()  # a backend's own threads may fail the request

    # --- hooks: how bytes move ---

    def _send(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Move one layer (checked already: the next in order, the header's shape and dtype)."""
        raise NotImplementedError

    def _finish(self, timeout: float | None) -> None:
        """Every layer went to `_send`: end the frame OK and wait until it has left (or been acknowledged)."""
        raise NotImplementedError

    def _abort(self, reason: str) -> None:
        """End the frame in-band as aborted. Called once, while the request is open; its error propagates."""
        raise NotImplementedError

    def _check(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A backend's own argument checks: raise TransferError("protocol") to refuse the call."""

    def _heard(self) -> TransferError | None:
        """A back channel, polled before each call and by `status`: the failure the receiver caused, or None."""
        return None

    def _end(self, error: TransferError | None) -> None:
        """The request ended, once: a success or an abort (None), or a failure. Free what it held."""

    # --- the interface ---

    @property
    def closed(self) -> bool:
        """Ended (finished, failed or aborted): its link may open the next request."""
        return self._state not in _OPEN

    def send_layer(self, layer_idx, key, value):
        self._refuse_if_ended("send_layer")
        check_layer(self.header, self._next, layer_idx, key, value)
        self._check(layer_idx, key, value)
        self._run(self._send, layer_idx, key, value)
        self._next += 1
        with self._lock:
            if self._state in _OPEN:
                self._state = TransferState.TRANSFERRING

    def finish(self, timeout=None):
        if self._state == TransferState.SUCCESS:
            return
        self._refuse_if_ended("finish")
        if self._next != self.header.num_layers:
            raise TransferError("protocol", f"finish after {self._next} of {self.header.num_layers} layers")
        self._run(self._finish, timeout)
        with self._lock:
            done = self._state in _OPEN
            if done:
                self._state = TransferState.SUCCESS
        if not done:  # failed (or aborted) on another thread while finishing
            raise self._refusal("finish")
        self._end(None)

    def abort(self, reason):
        with self._lock:
            if self._state not in _OPEN:
                return
            self._aborted, self._state = reason, TransferState.FAILED
        try:
            self._abort(reason)
        finally:
            self._end(None)

    def status(self):
        self._poll()
        return self._state

    # --- transitions ---

    def _fail(self, err: TransferError) -> TransferError:
        """Record a failure (any thread): the first one ends the request. Returns what the caller raises."""
        with self._lock:
            first = self._state in _OPEN
            if first:
                self._error, self._state = _again(err), TransferState.FAILED
        if first:
            self._end(self._error)
            return err
        return _again(self._error) if self._error is not None else err

    def _run(self, hook, *args) -> None:
        try:
            hook(*args)
        except TransferError as e:
            raise self._fail(e)

    def _poll(self) -> None:
        if self._state in _OPEN and (err := self._heard()) is not None:
            self._fail(err)

    def _refusal(self, what: str) -> TransferError:
        if self._error is not None:
            return _again(self._error)
        if self._aborted is not None and what == "finish":
            return TransferError("aborted", f"finish after abort ({self._aborted})")
        return TransferError("protocol", f"{what} after the transfer ended ({self._state.name})")

    def _refuse_if_ended(self, what: str) -> None:
        self._poll()
        if self._state not in _OPEN:
            raise self._refusal(what)
