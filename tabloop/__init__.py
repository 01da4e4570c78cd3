"""tabloop: the command line that wires the service and the trainer into processes, and
`tabloop.client`, the Python client for editor plugins."""
