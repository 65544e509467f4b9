"""ddtree-jax: DDTree speculative decoding on DFlash drafters, in JAX/Pallas.

The Python API (api.py): `LLM` loads a target and drafter once; `LLM.generate` / `LLM.chat` run prompts
under `SamplingParams` and return vLLM-shaped `RequestOutput`s, `LLM.stream` / `LLM.results` `Result`s.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "Result", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:  # imported on use, so that `import ddtree_jax` stays light
        from ddtree_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'ddtree_jax' has no attribute {name!r}")
