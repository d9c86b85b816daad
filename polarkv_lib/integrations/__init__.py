"""Engine integrations: vLLM, SGLang, transformers. Each imports its engine lazily."""
