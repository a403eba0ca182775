"""What ran for a request (the mode), in code and on the wire (kvtransfer.proto's `Mode`).

Why an enum: the bench, the metrics and the servers all read it; a free string mapped in
several places drifts.
"""

from __future__ import annotations

import enum

from proto import kvtransfer_pb2 as pb


class Mode(enum.StrEnum):
    AUTO = "auto"                # request only: the prefill server's measured policy picks
    LAYERWISE = "layerwise"      # layer i sent while layers i+1.. compute
    BULK = "bulk"                # the whole cache sent after prefill
    COLOCATED = "colocated"      # the decode worker prefilled itself (baseline)
    RECOMPUTE = "recompute"      # result only: the prefill peer failed, the decode worker prefilled itself

    @property
    def proto(self) -> int:
        return pb.Mode.Value(f"MODE_{self.name}")

    @classmethod
    def from_proto(cls, value: int) -> "Mode":
        return cls[pb.Mode.Name(value).removeprefix("MODE_")]


REQUEST_MODES = (Mode.AUTO, Mode.LAYERWISE, Mode.BULK, Mode.COLOCATED)
