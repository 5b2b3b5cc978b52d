"""Models: the CausalLM protocol, the native Llama-family runtime, weight loaders, registry."""
