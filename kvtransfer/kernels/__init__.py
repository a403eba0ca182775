"""The decode step's fused ops (ops.py), each with a plain-torch reference (reference.py) and a Triton kernel
(triton_*.py), chosen per call. Import `kvtransfer.kernels.ops`; this package itself imports nothing, so a
kernel module (the sm_90 compile check, the interpreter tests) loads without the op layer."""
