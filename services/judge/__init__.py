"""The judge proxy: episode-correctness and worker-contribution grades in front of an LLM grader,
or rule-based on the embedded default (`bcstack serve judge`)."""
