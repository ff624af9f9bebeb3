"""The contract between the processes: messages, the shared-memory layout, the doorbell."""
