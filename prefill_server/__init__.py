"""Prefill worker: runs the prompt, streams each layer's K/V to the decode worker."""
