"""Load generation against any OpenAI-compatible endpoint: trace replay (``traces``,
``transforms``, ``plan``, ``prompts``, ``replay``), SLO reports and plots (``slo``,
``report``, ``plots``, ``compare``), workload synthesis (``synth``). The command line is
``cli``; the trace readers are pure, for a simulator to reuse."""
