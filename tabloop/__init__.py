"""tabloop: the command line that wires the service and the trainer into processes."""
