"""CLIP as SELECT and CLASSIFY: visual prompt tokens in the image tower (``tool``), the calibrated margin serving
uses (``margin``), concept folders of rendered shapes (``synthetic``), the tiny open_clip model (``tiny``), the
quickstart's demo (``demo``) and the recipe naming them (``recipe``).
"""
