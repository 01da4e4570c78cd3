"""What every tabloop program shares: the API, the trainer and the simulator build on it."""
