"""The record of a run: compute spans, collectives and messages, exported as Chrome/Perfetto JSON."""
