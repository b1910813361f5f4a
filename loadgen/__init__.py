"""Load generation against any OpenAI-compatible endpoint: trace replay, workload
synthesis, SLO reports and a policy simulator (issue 4 grows this)."""
