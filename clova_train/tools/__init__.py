"""Layer 2, the prompt tools: one folder per tool (``clip``: SELECT / CLASSIFY, ``vqa``, ``loc``, ``seg``,
``replace``; ``grounding`` holds what LOC and SEG share), each with its recipe (``recipes``); the ``PromptTool`` base
class (``base``), its typed contracts (``contracts``), ``check_tool`` (``check``), pretrained-model loading
(``pretrained``), image reading (``images``), the tiny-model builders' shared pieces (``tiny_common``) and the one
server for every export (``prompt_server``). No Lightning.
"""
