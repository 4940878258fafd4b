"""Layer 2, the prompt tools: the ``PromptTool`` base class (``base``), its typed contracts (``contracts``),
one file per tool (``clip``: SELECT / CLASSIFY, ``blip_vqa``: VQA), ``check_tool`` (``check``), image
reading (``images``) and the one server for every export (``serving``). No Lightning.
"""
