"""A sixth prompt tool, kept outside the package as a user's own package would be: a toy classifier whose prompt is
a per-feature gain on its input vectors.

It is written the way docs/architecture.md ("A tool is a folder") and docs/prompt-tools.md ("Adding a tool") say a
user writes one, one module per piece:

* :mod:`toy_tool.tool`: the tool class (:class:`~toy_tool.tool.ToyPromptClassifier`, a
  :class:`~clova_train.tools.base.PromptTool`) and its training instance;
* :mod:`toy_tool.synthetic`: the synthetic concept vectors its data and its tiny model are drawn from;
* :mod:`toy_tool.data`: its datamodules (a vector file; a synthetic one writing that file first);
* :mod:`toy_tool.tiny`: its tiny-model builder (and the smoke run's "real-size" model);
* :mod:`toy_tool.demo`: what ``make demo-toy`` prints after the quickstart;
* :mod:`toy_tool.benchmark`: the smoke run's data writer;
* :mod:`toy_tool.recipe`: the :class:`~clova_train.tools.recipes.ToolRecipe` naming all of them, with the
  quickstart and paper configs in ``configs/``.

The folder beside it, ``toy_tool-0.1.dist-info``, is what installing such a package leaves on ``sys.path``: its
``entry_points.txt`` declares the recipe under the ``clova_train.tool_recipes`` group. Putting ``tests/plugins`` on
``PYTHONPATH`` is the whole installation; nothing in the repository names the toy
(``tests/tools/test_adding_a_tool.py``).
"""
