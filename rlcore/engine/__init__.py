"""Model building (built-in tiny model or a local HF folder), FSDP2, log-prob forwards."""
