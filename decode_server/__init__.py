"""Decode worker and front door: Generate, cache receive + assembly, decoding."""
