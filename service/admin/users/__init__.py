"""Per-person data: purging a user's rollouts, events, rewards and log messages."""
