"""``torch.cuda`` and ``torch.accelerator`` in rank code, answered from the run's simulated GPUs: devices and
their properties, events and streams in simulated time, memory from the run's accounting, per-device random
generators; and the switch that puts all of it in place for a run and takes it away afterwards."""
