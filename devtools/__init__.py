"""Development tools, not shipped in the wheel: the offline model generator (`modelgen`)
and the vLLM CPU installer (`vllm_cpu`)."""
