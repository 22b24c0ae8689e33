"""The convention audit: how head-level conclusions change when the sink is included or removed."""
