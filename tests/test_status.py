"""The status tables (kvtransfer/transport/status.py), every row of both checked against docs/errors.md.

Why against the document: operators read the table there to tell what a status means; a row changed in the code
and not in the doc (or the reverse) misleads them, so each test fails on either drift.
"""

from __future__ import annotations

import os

import grpc

from kvtransfer.transport import Cause, TransferError
from kvtransfer.transport.status import _CAUSE_OF_BARE_STATUS, CAUSE_STATUS, cause_of_status, transfer_status
from proto import kvdata_pb2

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "errors.md")


def doc_table(header: str) -> dict[str, str]:
    """The docs/errors.md table whose header line is `header`: first column -> second, backticks stripped."""
    lines = open(DOC).read().splitlines()
    assert lines.count(header) == 1, f"docs/errors.md has one table headed {header!r}"
    rows = []
    for line in lines[lines.index(header) + 2:]:  # past the header and its --- line
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")][:2])
    table = dict(rows)
    assert len(table) == len(rows), f"a row twice in {header!r}"
    return table


def test_every_cause_has_the_documented_status():
    doc = doc_table("| cause | status | when |")
    assert set(doc) == {c.value for c in Cause}, "docs/errors.md documents every cause once"
    for cause in Cause:
        assert CAUSE_STATUS[cause].name == doc[cause.value], cause
        assert transfer_status(TransferError(cause, "x")) == CAUSE_STATUS[cause]


def test_every_bare_status_maps_back_to_the_documented_cause():
    """A stream ended without the typed trailer: the doc lists exactly the code's rows, and every gRPC status code
    maps back to its row's cause, one not listed to the `any other` row's."""
    doc = doc_table("| status, no trailer | cause | when |")
    other = doc.pop("any other")
    assert set(doc) == {code.name for code in _CAUSE_OF_BARE_STATUS}, "docs/errors.md lists the table's codes"
    for code in grpc.StatusCode:
        assert cause_of_status(code).value == doc.get(code.name, other), code


def test_cause_enum_matches_the_proto():
    for i, c in enumerate(Cause, start=1):
        assert kvdata_pb2.Cause.Name(i) == f"CAUSE_{c.name}"


def test_transfer_error_refuses_an_unknown_cause():
    import pytest
    with pytest.raises(ValueError):
        TransferError("exploded", "no such cause")


def test_a_call_cancelled_at_its_deadline_counts_as_deadline_exceeded():
    """The client's deadline runs out a few ms before the server's: that cancellation is the deadline's."""
    import asyncio

    from kvtransfer.rpc.lifecycle import DEADLINE_SLACK_S, outcome

    class Ctx:
        def __init__(self, left):
            self.left = left

        def code(self):
            return None

        def time_remaining(self):
            return self.left

    cancelled = asyncio.CancelledError()
    assert outcome(Ctx(0.004), cancelled) == "DEADLINE_EXCEEDED"
    assert outcome(Ctx(-1.0), cancelled) == "DEADLINE_EXCEEDED"
    assert outcome(Ctx(DEADLINE_SLACK_S + 1.0), cancelled) == "CANCELLED"
    assert outcome(Ctx(None), cancelled) == "CANCELLED"  # no deadline at all
    assert outcome(Ctx(0.0), None) == "OK"


def test_a_server_ends_a_request_before_the_clients_deadline():
    """Its own DEADLINE_EXCEEDED, with the reason, goes out while the call is still open (not racing gRPC's)."""
    import pytest

    from kvtransfer.rpc.lifecycle import DEADLINE_MARGIN_S, request_budget

    assert request_budget(None, 30.0) == 30.0                      # no client deadline: the server's limit
    assert request_budget(100.0, 30.0) == 30.0                     # the limit is the shorter
    assert request_budget(10.0, 30.0) == 10.0 - DEADLINE_MARGIN_S  # the client's, less the margin
    assert request_budget(0.2, 30.0) == pytest.approx(0.15)                      # a short deadline: a quarter of it at most
    assert request_budget(-1.0, 30.0) == 0.0                       # already past


def test_abort_on_a_finished_call_sends_nothing():
    """The client went or its deadline passed: the handler unwinds as cancelled; no status write fails in core."""
    import asyncio

    import grpc
    import pytest

    from decode_server.request_path import abort

    class Ctx:  # grpc.aio's: done() is "status sent"; a deadline that passed shows as time_remaining() == 0
        def __init__(self, done, left=None, cancelled=False):
            self.is_done, self.left, self.is_cancelled, self.aborted = done, left, cancelled, []

        def done(self):
            return self.is_done

        def cancelled(self):
            return self.is_cancelled

        def time_remaining(self):
            return self.left

        async def abort(self, code, message):
            self.aborted.append(code)
            raise grpc.RpcError(message)

    for gone in (Ctx(True), Ctx(False, left=0.0), Ctx(False, cancelled=True)):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(abort(gone, grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
        assert gone.aborted == []
    open_ = Ctx(False, left=0.05)
    with pytest.raises(grpc.RpcError):
        asyncio.run(abort(open_, grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    assert open_.aborted == [grpc.StatusCode.DEADLINE_EXCEEDED]
