"""The recurrent-layer shapes of a Hugging Face model or config (`LayerShape`, the unit of the
byte model in `replayquant.statebytes`), read from the layer modules that the patch finds.
Kept apart from the byte model so that counting bytes imports nothing of the models."""

from __future__ import annotations

import torch

from replayquant.models.patching import layer_shapes, model_from_config
from replayquant.statebytes import LayerShape

__all__ = ["config_shapes", "layer_shapes"]


def config_shapes(cfg) -> tuple[list[LayerShape], object]:
    """(LayerShapes of the recurrent layers, the model built on the meta device) of a model
    config, with the class load_model uses (`model_class`: GLM-5-Next's
    conditional-generation class), so no weights load; no shapes for a model without one."""
    with torch.device("meta"):
        meta = model_from_config(cfg)
    return layer_shapes(meta), meta
