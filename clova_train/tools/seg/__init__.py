"""MaskFormer as SEG: prompt tokens in the class queries (``tool``), the tiny MaskFormer (``tiny``) and the recipe
(``recipe``); data, demo and instances are the grounding family's (:mod:`clova_train.tools.grounding`).
"""
