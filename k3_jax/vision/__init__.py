"""Vision for K3: the MoonViT3d tower, the patch-merger projector, the media plan and the image processor.

Kept import-light (``k3_jax.config`` imports :mod:`k3_jax.vision.config`); import the submodules directly:
:mod:`~k3_jax.vision.tower` (Flax modules), :mod:`~k3_jax.vision.attention` (packed block-diagonal attention),
:mod:`~k3_jax.vision.plan` (host-side packing of media), :mod:`~k3_jax.vision.processor` (images / video frames
-> ``pixel_values``, ``grid_thws``), :mod:`~k3_jax.vision.content` (chat content parts with images),
:mod:`~k3_jax.vision.train` (image-text batches and loss), :mod:`~k3_jax.vision.shapes_data` (the bundled
procedural image-text example). The model is :mod:`k3_jax.multimodal`; serving images: :mod:`k3_jax.serving.media`.
"""

from k3_jax.vision.config import VisionConfig, count_vision_params, vision_config_from_dict

__all__ = ["VisionConfig", "count_vision_params", "vision_config_from_dict"]
