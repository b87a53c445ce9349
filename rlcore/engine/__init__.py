"""Model building (built-in tiny model or a local HF folder), training strategies (ddp, fsdp),
sequence forwards (padded, packed) and the collectives of a worker rank."""
