"""Figures and reports, from the JSON the commands write (so they can be redrawn without a model)."""
