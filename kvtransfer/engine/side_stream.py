"""Work that runs beside the step's stream: a side CUDA stream forked from it and joined back.

Why: in a mixed step the decode rows' attention reads the pool at memory speed while the prompt rows' attention
is a few hundred small tensor-core programs, and neither fills the GPU alone. Forked from the step's stream (the
side stream waits for everything queued so far) and joined before the output is read, the two run at once, in a
CUDA graph too (capture follows a fork and join as graph edges). Off CUDA, the block runs inline.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class SideStream:
    def __init__(self, device: torch.device, on: bool = True):
        self.stream = torch.cuda.Stream(device) if on and device.type == "cuda" else None

    @contextmanager
    def fork(self):
        """Run the block on the side stream, after everything queued on the current one."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The current stream waits for what the side stream was given."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
