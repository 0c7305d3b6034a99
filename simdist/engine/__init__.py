"""The run: the composition root that builds a simulated cluster's clock, ranks and communication and runs a
function on every rank (``simdist.run``), with the process-wide state a run changes and the rank-code API."""
