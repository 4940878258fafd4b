"""BLIP as VQA: prompt tokens before the question (``tool``), its JSONL records (``records``), synthetic shape
questions (``synthetic``), the tiny BLIP (``tiny``), the demo (``demo``) and the recipe (``recipe``).
"""
