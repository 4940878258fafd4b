"""Stable Diffusion inpainting as REPLACE: a learned token (textual inversion, ``tool``), masked shapes
(``synthetic``), the tiny inpainting pipeline (``tiny``), the demo (``demo``) and the recipe (``recipe``).
"""
