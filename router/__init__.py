"""kvtransfer-router: one gRPC front door (the Decode service) over several decode workers (docs/router.md)."""
