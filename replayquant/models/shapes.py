"""The recurrent-layer shapes of a Hugging Face model or config (`LayerShape`, the unit of the
byte model in `replayquant.statebytes`), read from the layer modules that the patch finds.
Kept apart from the byte model so that counting bytes imports nothing of the models."""

from __future__ import annotations

import torch

from replayquant.models.patching import model_from_config, recurrent_layers
from replayquant.statebytes import LayerShape

__all__ = ["config_shapes", "layer_shapes"]


def config_shapes(cfg) -> tuple[list[LayerShape], object]:
    """(LayerShapes of the recurrent layers, the model built on the meta device) of a model
    config, with the class load_model uses (`model_class`: GLM-5-Next's
    conditional-generation class), so no weights load; no shapes for a model without one."""
    with torch.device("meta"):
        meta = model_from_config(cfg)
    return layer_shapes(meta), meta


def layer_shapes(model) -> list[LayerShape]:
    """The LayerShape of every recurrent layer of a Hugging Face model (as `recurrent_layers`
    finds them): GDN value / key heads and head dims, KDA heads and head dim (q, k, v alike),
    Mamba-2 heads, groups, head dim and state size, read from the layer modules."""
    out = []
    for name, m, kind in recurrent_layers(model):
        if kind == "gdn":
            H, HK, dv, dk = m.num_v_heads, m.num_k_heads, m.head_v_dim, m.head_k_dim
        elif kind == "kda":
            H, HK, dv, dk = m.num_heads, m.num_heads, m.head_dim, m.head_dim
        else:
            H, HK, dv, dk = m.num_heads, m.n_groups, m.head_dim, m.ssm_state_size
        out.append(LayerShape(kind, int(H), int(HK), int(dv), int(dk), name, int(m.layer_idx)))
    return out
