"""Task executor: a node pool of pre-warmed, model-agnostic TE processes, each wrapping one engine."""
