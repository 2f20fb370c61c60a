"""Serving: continuous-batching decode engine, sampling, paged MLA latent cache, prefix cache, chat format, HTTP
server.

``from k3_jax.serving import Engine``; see :mod:`k3_jax.serving.engine`.
"""

from k3_jax.serving.engine import Engine, RequestError, TokenEvent
from k3_jax.serving.prefix_cache import PrefixCacheConfig
from k3_jax.serving.sampling import SamplingParams

__all__ = ["Engine", "PrefixCacheConfig", "RequestError", "SamplingParams", "TokenEvent"]
