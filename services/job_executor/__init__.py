"""Job executor: request → job → task; which TE runs each task; holding jobs while a model
scales from zero."""
