"""The convention audit: do conclusions about heads survive removing the sink?

Pure functions of head x head matrices (DESIGN section 5). A matrix is either a
similarity (larger = more alike, e.g. cosine) or a distance (e.g. JS).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def nearest_neighbours(m: Tensor, similarity: bool) -> Tensor:
    """Index of each head's nearest other head within its layer. m: (layer, head, head) -> (layer, head)."""
    eye = torch.eye(m.shape[-1], dtype=torch.bool, device=m.device)
    if similarity:
        return m.masked_fill(eye, float("-inf")).argmax(-1)
    return m.masked_fill(eye, float("inf")).argmin(-1)


def nn_flip_rate(full: Tensor, content: Tensor, similarity: bool) -> Tensor:
    """Per layer, the share of heads whose nearest neighbour changes between conventions. (layer,)"""
    return (nearest_neighbours(full, similarity) != nearest_neighbours(content, similarity)).double().mean(-1)
