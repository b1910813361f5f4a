"""Training tasks a TE runs in its training mode (fine-tuning jobs: issue 30)."""
