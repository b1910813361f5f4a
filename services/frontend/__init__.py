"""The HTTP frontend: the OpenAI-compatible API in front of the job executors."""
