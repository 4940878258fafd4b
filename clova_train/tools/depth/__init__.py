"""A frozen depth-estimation tool: HYDRA's and ViperGPT's ``ImagePatch.compute_depth`` (the median depth of a patch).

Not a prompt tool (no recipe, nothing learned): a transformers depth-estimation model loaded from a directory or hub
id (``estimator``), its request format (``request``) and a tiny random-weight model of a real architecture for tests
and offline runs (``tiny``). ``clova-train serve <model dir>`` serves it at ``POST /v1/depth``.
"""

from typing import Any

__all__ = ["DepthEstimator", "check_depth_model_dir", "depth_model_type"]


def __getattr__(name: str) -> Any:
    # Imported on first use: finding the tool recipes looks into every folder of clova_train.tools, which imports
    # this package, and commands that only list or explain things (``tiny-model --help``) must not import torch.
    if name in __all__:
        from clova_train.tools.depth import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
