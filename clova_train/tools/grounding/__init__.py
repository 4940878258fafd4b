"""What LOC and SEG share (no recipe of its own): grounding instances and gates (``instances``), COCO/LVIS
annotations (``coco``), synthetic COCO-format scenes (``synthetic``) and the demo both run (``demo``).
"""
