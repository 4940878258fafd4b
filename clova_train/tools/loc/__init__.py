"""OWL-ViT as LOC: prompt tokens in the query text (``tool``), its detection losses (``detection_losses``), the tiny
OWL-ViT (``tiny``) and the recipe (``recipe``); data, demo and instances are the grounding family's
(:mod:`clova_train.tools.grounding`).
"""
