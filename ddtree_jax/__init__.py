"""ddtree-jax: DDTree speculative decoding on DFlash drafters, in JAX/Pallas."""

__version__ = "0.1.0"
