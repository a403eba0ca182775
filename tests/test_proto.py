"""The committed stubs are what grpcio-tools makes of the committed .proto files."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools (dev extra) not installed")


@pytest.mark.parametrize("proto", sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "proto", "*.proto"))))
def test_stubs_are_fresh(tmp_path, proto):
    os.makedirs(tmp_path / "proto")
    shutil.copy(os.path.join(ROOT, "proto", proto), tmp_path / "proto" / proto)
    rc = protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      f"--pyi_out={tmp_path}", str(tmp_path / "proto" / proto)])
    assert rc == 0
    stem = proto.removesuffix(".proto")
    for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
        with open(tmp_path / "proto" / f"{stem}{suffix}") as f, open(os.path.join(ROOT, "proto", stem + suffix)) as g:
            assert f.read() == g.read(), f"proto/{stem}{suffix} is stale: run `make proto` and commit"


def test_generate_callable_from_proto_alone():
    """Any gRPC client can call Generate from the .proto: the service and messages are public and typed."""
    from proto import kvtransfer_pb2 as pb
    svc = pb.DESCRIPTOR.services_by_name["Decode"]
    m = svc.methods_by_name["Generate"]
    assert m.server_streaming and not m.client_streaming
    assert m.input_type.full_name == "kvtransfer.v1.GenerateRequest"
