"""``clova-train report``: a run directory turned into pictures (matplotlib) and a markdown page.

:func:`~clova_train.report.page.write_report` finds what the run wrote (``runs``), draws it (``figures``) and
writes ``report.md`` beside the pictures.
"""

from clova_train.report.page import write_report

__all__ = ["write_report"]
