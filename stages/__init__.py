"""Thin CLIs, one per DVC stage: parse, load the stage's params, call rlcore, write declared outs."""
