"""Models: the `CausalLM` protocol (`base.py`: the seam the engine, drafters, heads and `train/` type
against), the native Llama-family runtime (`llama.py`), weight loaders, registry."""
