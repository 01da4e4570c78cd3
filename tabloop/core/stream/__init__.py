"""The event log the trainer reads: Kafka topics in full mode, the outbox table in embedded mode."""
