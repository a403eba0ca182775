"""The decode worker's front door: Generate, its defaults and its link to the prefill worker (peer/); the engine
it drives is kvtransfer/engine/."""
