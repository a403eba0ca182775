"""Run a module (`python3 patched.py -m MODULE ARGS...`) with the attention launch that call 1's pair sweep chose:
KVT_PATCH="SIDE WARPS HEADS" sets runner.SIDE_KERNEL and triton_attention_split.STAGE2_WARPS / STAGE2_HEADS first.
A bench-only shim for an A/B in one call: the defaults stay in the code."""
import os
import runpy
import sys

from kvtransfer.engine import runner
from kvtransfer.kernels import triton_attention_split as split

side, warps, heads = os.environ["KVT_PATCH"].split()
runner.SIDE_KERNEL, split.STAGE2_WARPS, split.STAGE2_HEADS = side, int(warps), int(heads)
print(f"patched: SIDE_KERNEL={side} STAGE2_WARPS={warps} STAGE2_HEADS={heads}", file=sys.stderr)
assert sys.argv[1] == "-m", sys.argv
module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
