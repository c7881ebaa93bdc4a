"""OpusLM serving engine: the model, its vLLM plugin, the codec stage and the service."""
