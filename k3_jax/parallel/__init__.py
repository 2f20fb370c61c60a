"""Multi-device forms of the layers: each takes global arrays inside ``jit`` and wraps a per-shard body in
``jax.shard_map`` over the named axes of :mod:`sharding.mesh`, and equals the single-device layer math.

* :mod:`k3_jax.parallel.sequence` — tokens split over ``sequence``: KDA by a prefix scan of per-shard affine
  state maps over the devices, the short conv by a halo exchange, MLA by an all-gather of the latent.
* :mod:`k3_jax.parallel.expert` — routed experts split over ``expert`` (all-gather or ragged all-to-all).
* :mod:`k3_jax.parallel.vocab` — embedding and cross-entropy with the vocabulary split over ``tensor``.

The layers (``k3_jax.layers``) choose these forms from the active mesh; this package imports nothing from the
layers or the model (a layer passes its per-shard attention in, e.g. ``mla_sequence_parallel(attend=...)``).
"""
