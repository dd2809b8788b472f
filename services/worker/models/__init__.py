"""One module per model family (its config, its weights, its layers) and the registry
that finds a family by its Hugging Face model_type or GGUF architecture."""
